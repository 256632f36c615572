"""The session table: which endpoint each live session is pinned to, per cluster.

A session keeps its endpoint while the endpoint stays pinnable (healthy, in the cluster), even
when endpoints are added: the ring alone would move ~1/n of the sessions on scale-up, the table
moves none (case C12 for live sessions). Entries go after ``ttl_s`` without a request (idle) and
the least recently used go first when the table is full.

Keys are 64-bit integers derived from BLAKE2b hashes of the session key and the cluster name
(:func:`session_slot`): the raw session key is never stored nor logged. Everything runs on the
picker's event loop; no locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter, Gauge

__all__ = ["SessionTable", "pin_after", "session_slot"]

SESSIONS = Gauge("inferlb_ext_proc_sessions", "Sessions in the picker's session table.")
EVICTIONS = Counter("inferlb_ext_proc_session_evictions_total", "Sessions dropped from the table, by cause.",
                    ["cause"])

_MASK = (1 << 64) - 1


def session_slot(key_hash: int, cluster_hash: int) -> int:
    """The table key of one session in one cluster: the two 64-bit hashes mixed (XOR)."""
    return (key_hash ^ cluster_hash) & _MASK


def pin_after(pinned: str | None, chosen: str, reason: str, spills: int, move_after: int
              ) -> tuple[str, int, bool]:
    """How a session's pin changes after one decision (pure).

    Args:
        pinned: the pin before (None: a new session).
        chosen: the endpoint the request went to.
        reason: the decision's outcome (:data:`ext_proc.scheduling.OUTCOMES`).
        spills: the session's spills in a row before this request.
        move_after: spills in a row that move the pin (>= 1; 1 = move at the first spill).

    Returns:
        ``(pin, spills in a row, moved)``: a new session, or one whose pinned endpoint is gone
        (``repinned``), is pinned to ``chosen``; a spill (``spilled``, ``memory``) keeps the old pin
        until ``move_after`` spills in a row (a burst does not scatter a conversation), then the
        pin moves there.

    >>> pin_after("a", "b", "spilled", 0, 3), pin_after("a", "b", "spilled", 2, 3)
    (('a', 1, False), ('b', 0, True))
    >>> pin_after("a", "a", "affinity", 2, 3)
    ('a', 0, False)
    """
    if pinned is None or pinned == chosen:
        return chosen, 0, False
    if reason in ("spilled", "memory"):
        spills += 1
        if spills >= move_after:
            return chosen, 0, True
        return pinned, spills, False
    return chosen, 0, True


class SessionTable:
    """Pinned endpoint per session slot, with an idle TTL and an LRU size bound.

    Args:
        ttl_s: a session idle for longer is forgotten (s, > 0). Default 30 min.
        max_sessions: at most this many entries; the least recently used is evicted first (>= 1).
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: ``ttl_s`` <= 0 or ``max_sessions`` < 1.
    """

    __slots__ = ("_entries", "_ttl", "_max", "_clock", "_lru_evicted")

    def __init__(self, ttl_s: float = 1800.0, max_sessions: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._ttl = ttl_s
        self._max = max_sessions
        self._clock = clock
        self._lru_evicted = 0  # published by sweep(): no metrics lock on the request path

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, slot: int) -> str | None:
        """The endpoint pinned for ``slot``, or None when unknown or idle past the TTL (read only)."""
        entry = self._entries.get(slot)
        if entry is None or self._clock() - entry[1] > self._ttl:
            return None
        return entry[0]

    def touch(self, slot: int, endpoint: str) -> None:
        """Record a request of ``slot`` pinned to ``endpoint`` (now the most recently used)."""
        entries = self._entries
        if slot in entries:
            entries.move_to_end(slot)
        elif len(entries) >= self._max:
            entries.popitem(last=False)
            self._lru_evicted += 1
        entries[slot] = (endpoint, self._clock())

    def sweep(self) -> int:
        """Drop sessions idle past the TTL (oldest first, stopping at the first live one) and publish
        the metrics (call every second or so); returns how many were dropped."""
        entries = self._entries
        limit = self._clock() - self._ttl
        dropped = 0
        while entries:
            slot, (_, seen) = next(iter(entries.items()))
            if seen >= limit:
                break
            del entries[slot]
            dropped += 1
        if dropped:
            EVICTIONS.labels("ttl").inc(dropped)
        if self._lru_evicted:
            EVICTIONS.labels("lru").inc(self._lru_evicted)
            self._lru_evicted = 0
        SESSIONS.set(len(entries))
        return dropped
