"""Exact peaks of requests in flight from the simulated backends' own request spans (pure).

Each backend keeps, per request that held it, ``(arrived, left)`` in wall-clock seconds
(``GET /sim/spans``, :attr:`sim.node.SimNode.spans`): from its arrival to the release of its slot
and memory. The peak of a node, or of a set of nodes (a tier), is the most spans open at one
instant, so no sampling interval can miss it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["peak_in_flight"]


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
