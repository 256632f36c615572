"""Exact peaks of requests in flight from the simulated backends' own request spans (pure).

Each backend keeps, per request that held it, ``(arrived, left)`` in wall-clock seconds
(``GET /sim/spans``, :attr:`sim.node.SimNode.spans`): from its arrival to the release of its slot
and memory. The peak of a node, or of a set of nodes (a tier), is the most spans open at one
instant, so no sampling interval can miss it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

__all__ = ["in_flight_at", "peak_in_flight"]


def peak_in_flight(spans: Iterable[tuple[float, float]], since: float) -> int:
    """The most of ``spans`` open at once at or after ``since`` (wall s); 0 without any.

    A span that leaves at the instant another arrives does not overlap it (the leave counts first).

    >>> peak_in_flight([(0, 3), (1, 2), (2, 4), (5, 6)], 0), peak_in_flight([(0, 3), (1, 2)], 2.5)
    (2, 1)
    """
    events: list[tuple[float, int]] = []
    for arrived, left in spans:
        if left >= since:
            events.append((max(arrived, since), 1))
            events.append((left, -1))
    events.sort()
    now = peak = 0
    for _, step in events:
        now += step
        if now > peak:
            peak = now
    return peak


def in_flight_at(spans: Iterable[tuple[float, float]]) -> Callable[[float], int]:
    """A function of ``t`` (wall s): how many of ``spans`` arrived before ``t`` and had not left by
    then (a span arriving at ``t`` itself is not counted).

    >>> f = in_flight_at([(0, 3), (1, 2)])
    >>> f(0), f(1), f(1.5), f(2), f(3)
    (0, 1, 2, 1, 0)
    """
    listed = list(spans)
    arrivals = sorted(a for a, _ in listed)
    departures = sorted(b for _, b in listed)
    return lambda t: bisect_left(arrivals, t) - bisect_right(departures, t)
