"""Memory per session in the picker's session table (tracemalloc over real inserts)."""

from __future__ import annotations

import tracemalloc

from ext_proc.ring import key_hash
from ext_proc.sessions import SessionTable, session_slot


def bytes_per_session(n: int = 200_000, endpoints: int = 16) -> float:
    """Python heap bytes one more session costs, averaged over ``n`` inserts (keys hashed, as the picker does).

    Endpoint names are shared strings (the view owns them), so they are not counted per session.
    """
    names = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(endpoints)]
    salt = key_hash(b"chat-v1")
    hashes = [key_hash(b"user-%d" % i) for i in range(n)]
    table = SessionTable(max_sessions=n)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i, h in enumerate(hashes):
        table.touch(session_slot(h, salt), names[i % endpoints])  # the slot int is stored: counted
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    return grown / n
