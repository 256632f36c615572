"""Envoy's earliest-deadline-first scheduler (``source/common/upstream/edf_scheduler.h``), the weighted
round robin schedule behind ``ROUND_ROBIN`` with unequal weights and ``LEAST_REQUEST`` with unequal
weights.

Each entry has a deadline; :meth:`Edf.pick` takes the entry with the earliest deadline (ties: the
one added first) and puts it back with ``deadline + 1 / weight``, its weight asked again at that
moment (``LEAST_REQUEST`` asks for a weight adjusted to the host's load then). Envoy starts the
schedule at a random point so replicas do not move in lockstep; here the run's generator draws how
many picks to skip (at most the number of entries).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence

__all__ = ["Edf"]


class Edf:
    """A weighted round robin over ``items`` by earliest deadline first.

    Args:
        items: the entries (addresses), in a stable order.
        weight: an entry's current weight (> 0).
        rng: draws the schedule's starting point.
    """

    def __init__(self, items: Sequence[str], weight: Callable[[str], float], rng: random.Random) -> None:
        self._weight = weight
        self._seq = 0
        self._heap: list[tuple[float, int, str]] = []
        for item in items:
            self._push(0.0, item)
        for _ in range(rng.randrange(len(items)) if items else 0):
            self.pick()

    def _push(self, now: float, item: str) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (now + 1.0 / max(self._weight(item), 1e-12), self._seq, item))

    def pick(self) -> str:
        """The next entry of the schedule."""
        deadline, _, item = heapq.heappop(self._heap)
        self._push(deadline, item)
        return item
