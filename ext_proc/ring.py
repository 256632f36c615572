"""Consistent hashing with bounded loads.

Source: V. Mirrokni, M. Thorup, M. Zadimoghaddam, "Consistent Hashing with Bounded Loads",
SODA 2018 (arXiv:1608.01350, 2016/2017). Every endpoint owns ``vnodes`` points on a 64-bit ring;
a key goes to the owner of the first point clockwise from the key's hash. With loads, an
endpoint whose load has reached the capacity ``ceil(c * (total + 1) / n)`` is skipped and the
walk goes on clockwise, so no endpoint ever holds more than ``ceil(c * average)`` keys while
adding or removing an endpoint still moves only about ``1/n`` of the keys.

Hashes come from ``hashlib.blake2b(digest_size=8)``: the same ring, and the same answers, in
every process and on every run (Python's ``hash()`` is salted per process and is never used).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from hashlib import blake2b

__all__ = ["HashRing", "key_hash"]


def key_hash(data: bytes) -> int:
    """Return the ring position of ``data``: an unsigned 64-bit int from an 8-byte BLAKE2b digest."""
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """An immutable hash ring over endpoints named ``"HOST:PORT"``.

    Build it once per endpoint set (it hashes ``len(endpoints) * vnodes`` points, about
    0.5 µs each) and share it freely: ``lookup`` reads only, so it is safe from any thread or
    task without a lock.

    Args:
        endpoints: endpoint names; order and duplicates do not matter (the ring is a function
            of the set of names).
        vnodes: points per endpoint (virtual nodes), at least 1. More points spread keys more
            evenly; 160 gives a few percent of imbalance.

    Raises:
        ValueError: ``vnodes`` is below 1.
    """

    __slots__ = ("_endpoints", "_points", "_owners", "_vnodes")

    def __init__(self, endpoints: Sequence[str], vnodes: int = 160) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        names = tuple(sorted(set(endpoints)))
        # Ties between two points' hashes (astronomically rare) are broken by name, so the ring
        # stays a function of the endpoint set.
        points = sorted((key_hash(f"{name}#{i}".encode()), name) for name in names for i in range(vnodes))
        self._endpoints: tuple[str, ...] = names
        self._points: list[int] = [p for p, _ in points]
        self._owners: list[str] = [name for _, name in points]
        self._vnodes = vnodes

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The distinct endpoint names on the ring, sorted."""
        return self._endpoints

    @property
    def vnodes(self) -> int:
        """Points per endpoint."""
        return self._vnodes

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
