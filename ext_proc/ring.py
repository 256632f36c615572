"""Consistent hashing with bounded loads.

Source: V. Mirrokni, M. Thorup, M. Zadimoghaddam, "Consistent Hashing with Bounded Loads",
SODA 2018 (arXiv:1608.01350, 2016/2017). Every endpoint owns ``vnodes`` points on a 64-bit ring;
a key goes to the owner of the first point clockwise from the key's hash. With loads, an
endpoint whose load has reached the capacity ``ceil(c * (total + 1) / n)`` is skipped and the
walk goes on clockwise, so no endpoint ever holds more than ``ceil(c * average)`` keys while
adding or removing an endpoint still moves only about ``1/n`` of the keys.

Hashes come from ``hashlib.blake2b(digest_size=8)``: the same ring, and the same answers, in
every process and on every run (Python's ``hash()`` is salted per process and is never used).
Point ``i`` of endpoint ``name`` is at ``key_hash(f"{name}#{i}")``.

Size: a ring holds at most :data:`POINTS_BUDGET` points. A cluster of more than
``POINTS_BUDGET // vnodes`` endpoints gets fewer points per endpoint (never below
:data:`MIN_VNODES`): endpoint ``name`` keeps its points ``0 .. k-1``, so one more endpoint past that
size drops at most one point of each endpoint (about ``1/k`` of the keys move, besides the ``1/n``
the new endpoint takes). At 60 000 endpoints that is 17 points each (1 million points, 8 MB of
positions; 160 each would be 9.6 million). With that many endpoints the spread of one endpoint's
share of the ring (about ``1/sqrt(k)``) is bounded by the load bound anyway.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from functools import lru_cache
from hashlib import blake2b
from operator import itemgetter

import numpy as np

__all__ = ["KEPT_KEY_BYTES", "KEPT_KEYS", "MIN_VNODES", "POINTS_BUDGET", "HashRing", "key_hash", "points_per_endpoint",
           "session_hash"]

POINTS_BUDGET = 1 << 20
"""Most points one ring holds (see the module docstring)."""

MIN_VNODES = 16
"""Fewest points per endpoint when :data:`POINTS_BUDGET` cuts them (unless ``vnodes`` is lower)."""

OWNERS_PIECE = 1 << 15
"""Points per C call when a ring lists its points' owners (see :func:`_owners`)."""


def key_hash(data: bytes) -> int:
    """Return the ring position of ``data``: an unsigned 64-bit int from an 8-byte BLAKE2b digest."""
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


#: Longest key whose hash :func:`session_hash` keeps (bytes): session ids are short.
KEPT_KEY_BYTES = 256
#: Most keys :func:`session_hash` keeps (the least recently used go first): at most ~5 MiB.
KEPT_KEYS = 16_384


@lru_cache(maxsize=KEPT_KEYS)
def _kept_hash(data: bytes) -> int:
    return key_hash(data)


def session_hash(data: bytes) -> int:
    """:func:`key_hash` of a session key, kept for keys of up to :data:`KEPT_KEY_BYTES` bytes (the
    last :data:`KEPT_KEYS` of them): a session's key comes back with each of its requests (BLAKE2b
    0.7 µs, a kept one 0.13 µs; timeit). The same value as :func:`key_hash` for every key."""
    return _kept_hash(data) if type(data) is bytes and len(data) <= KEPT_KEY_BYTES else key_hash(data)


def points_per_endpoint(endpoints: int, vnodes: int) -> int:
    """Points each of ``endpoints`` endpoints gets on a ring asked for ``vnodes`` per endpoint:
    ``vnodes`` while the ring stays within :data:`POINTS_BUDGET`, else the budget's share, at least
    ``min(vnodes, MIN_VNODES)``.

    >>> points_per_endpoint(4, 160), points_per_endpoint(60_000, 160), points_per_endpoint(10**6, 8)
    (160, 17, 8)
    """
    return min(vnodes, max(MIN_VNODES, POINTS_BUDGET // max(1, endpoints)))


def _owners(names: tuple[str, ...], owner_of: np.ndarray) -> list[str]:
    """``[names[j] for j in owner_of]``, :data:`OWNERS_PIECE` points per C call.

    At 60 000 endpoints a ring has a million points: listing their owners with one numpy call held
    the GIL for 40-90 ms (in the picker view's worker thread) and the event loop, which shares the
    GIL, waited as long in the first round (``python3 -m bench.scale_bench``). Pieces of numpy object
    arrays do not help (measured: fancy indexing and ``take``, with or without ``out``): numpy releases
    the GIL for an instant inside each call, and a thread waiting for the GIL that is woken then but
    finds it taken again restarts its 5 ms switch interval, so it waits for the whole loop. These
    pieces are Python lists and tuples: the GIL is never released inside one (~2-3 ms each), and a
    waiting thread gets it between two.
    """
    owners: list[str] = []
    for start in range(0, len(owner_of), OWNERS_PIECE):
        piece = owner_of[start:start + OWNERS_PIECE].tolist()
        owners += itemgetter(*piece)(names) if len(piece) > 1 else [names[piece[0]]]  # one item: not a tuple
    return owners


def _hash_row(name: str, start: int, stop: int) -> list[int]:
    return [int.from_bytes(blake2b(f"{name}#{i}".encode(), digest_size=8).digest(), "big")
            for i in range(start, stop)]


class HashRing:
    """An immutable hash ring over endpoints named ``"HOST:PORT"``.

    Build it once per endpoint set and share it freely: ``lookup`` reads only, so it is safe from
    any thread or task without a lock. Building hashes each new endpoint's points (about 0.6 µs a
    point) and sorts all points with numpy (which releases the GIL, so a large ring built in a
    worker thread does not stall an event loop); endpoints also on ``previous`` reuse its hashes.

    Args:
        endpoints: endpoint names; order and duplicates do not matter (the ring is a function
            of the set of names and ``vnodes``).
        vnodes: points per endpoint (virtual nodes), at least 1; fewer on a very large ring
            (:func:`points_per_endpoint`). More points spread keys more evenly; 160 gives a few
            percent of imbalance.
        previous: an earlier ring (any endpoints, any ``vnodes``) whose points are reused for
            the endpoints both have; the result is the same as without it.

    Raises:
        ValueError: ``vnodes`` is below 1.
    """

    __slots__ = ("_endpoints", "_points", "_owners", "_vnodes", "_rows")

    def __init__(self, endpoints: Sequence[str], vnodes: int = 160, previous: HashRing | None = None) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        names = tuple(sorted(dict.fromkeys(endpoints)))
        k = points_per_endpoint(len(names), vnodes)
        rows = self._hash_rows(names, k, previous)
        # Rows are in name order; ties between two points' hashes (astronomically rare) are sorted
        # again stably, so they go to the smaller name and the ring stays a function of the set.
        flat = rows.ravel()
        order = np.argsort(flat)
        points = flat[order]
        if len(points) > 1 and bool((points[1:] == points[:-1]).any()):
            order = np.argsort(flat, kind="stable")
            points = flat[order]
        self._endpoints: tuple[str, ...] = names
        self._points = array("Q", points.tobytes())
        self._owners: list[str] = _owners(names, order // k)
        self._vnodes = vnodes
        self._rows = rows

    def _hash_rows(self, names: tuple[str, ...], k: int, previous: HashRing | None) -> np.ndarray:
        """``(len(names), k)`` uint64: row ``j`` holds the points ``0 .. k-1`` of ``names[j]``."""
        rows = np.empty((len(names), k), dtype=np.uint64)
        old_index = {name: j for j, name in enumerate(previous._endpoints)} if previous is not None else {}
        found = [old_index.get(name, -1) for name in names]
        reuse = min(k, previous._rows.shape[1]) if previous is not None else 0
        if reuse:
            at = np.array(found, dtype=np.int64)
            kept = at >= 0
            rows[kept, :reuse] = previous._rows[at[kept], :reuse]
        for j, name in enumerate(names):
            start = reuse if found[j] >= 0 else 0
            if start < k:
                rows[j, start:] = _hash_row(name, start, k)
        return rows

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The distinct endpoint names on the ring, sorted."""
        return self._endpoints

    @property
    def vnodes(self) -> int:
        """Points per endpoint asked for (the ``vnodes`` argument)."""
        return self._vnodes

    @property
    def points(self) -> int:
        """Points on the ring (endpoints x :func:`points_per_endpoint`)."""
        return len(self._owners)

    @property
    def owners(self) -> list[str]:
        """The owner of each point, in ring order (read only: shared by every lookup)."""
        return self._owners

    def start_index(self, position: int) -> int:
        """Index in :attr:`owners` of the first point clockwise from ``position`` (0 on an empty ring)."""
        start = bisect_right(self._points, position)
        return 0 if start == len(self._owners) else start

    def __len__(self) -> int:
        """Number of distinct endpoints."""
        return len(self._endpoints)

    def __bool__(self) -> bool:
        return bool(self._endpoints)

    def lookup(
        self,
        key: bytes,
        loads: Mapping[str, int] | None = None,
        load_factor: float = 1.25,
    ) -> str | None:
        """Return the endpoint for ``key``, or ``None`` when the ring is empty.

        Args:
            key: the session key, raw bytes (any length).
            loads: current load per endpoint (for example requests in flight). ``None`` = plain
                consistent hashing: the owner of the first point clockwise. Endpoints missing
                from the mapping have load 0; entries for endpoints not on the ring are ignored.
            load_factor: ``c`` of the paper, at least 1.0. Capacity per endpoint is
                ``ceil(c * (sum of loads + 1) / n)``; walking clockwise, the first endpoint
                whose load is below capacity wins, each endpoint being checked once.

        Raises:
            ValueError: ``load_factor`` is below 1.0 (only checked when ``loads`` is given).
        """
        return self.lookup_hash(key_hash(key), loads, load_factor)

    def lookup_hash(
        self,
        position: int,
        loads: Mapping[str, int] | None = None,
        load_factor: float = 1.25,
    ) -> str | None:
        """As :meth:`lookup`, for a key already hashed with :func:`key_hash` (``position``)."""
        owners = self._owners
        if not owners:
            return None
        start = bisect_right(self._points, position)
        if start == len(owners):
            start = 0
        if loads is None:
            return owners[start]
        return self._bounded(start, loads, load_factor)

    def _bounded(self, start: int, loads: Mapping[str, int], load_factor: float) -> str:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        names = self._endpoints
        n = len(names)
        total = sum(loads.get(name, 0) for name in names)
        capacity = math.ceil(load_factor * (total + 1) / n)
        owners = self._owners
        size = len(owners)
        seen: set[str] = set()
        i = start
        # With c >= 1 some endpoint is below capacity (the least loaded one is below the
        # average), so the walk ends before all points are visited; the bound on steps only
        # guards against odd inputs such as negative loads.
        for _ in range(size):
            name = owners[i]
            if name not in seen:
                if loads.get(name, 0) < capacity:
                    return name
                seen.add(name)
                if len(seen) == n:
                    break
            i += 1
            if i == size:
                i = 0
        return owners[start]
