"""Protobuf wire format written by hand (pure): the pieces the encoders that bypass message objects
share (:mod:`xds_server.resources.endpoints`, :mod:`xds_server.ads.push`)."""

from __future__ import annotations

#: ``BYTE[n]``: the single byte ``n`` (0..255) as ``bytes``.
BYTE = [bytes([n]) for n in range(256)]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint: 7 bits a byte, least significant first."""
    if n < 0x80:
        return BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: ``tag`` (one byte: field number << 3 | 2), the length of ``payload``, ``payload``."""
    return BYTE[tag] + varint(len(payload)) + payload
