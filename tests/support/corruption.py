"""Corrupted protobuf bytes for the compiled decoders' differential tests (hypothesis)."""

from __future__ import annotations

from hypothesis import strategies as st


def corrupt(data: st.DataObject, base: bytes) -> bytes:
    """``base`` with 1-3 byte edits drawn from ``data``: a byte set, a byte inserted, or the rest cut."""
    edits = data.draw(st.lists(st.tuples(st.integers(0, max(0, len(base) - 1)), st.integers(0, 255),
                                         st.sampled_from(["set", "insert", "cut"])), min_size=1, max_size=3))
    buf = bytearray(base)
    for pos, byte, how in edits:
        pos = min(pos, len(buf))
        if how == "set" and pos < len(buf):
            buf[pos] = byte
        elif how == "insert":
            buf.insert(pos, byte)
        else:
            del buf[pos:]
    return bytes(buf)
