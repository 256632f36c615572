"""Edge -> cloud tiers: which tier of a cluster a request goes to (pure).

A cluster's EDS assignment may have two priority levels: 0, the edge tier, and 1, the cloud tier
(``tier`` in the endpoint config). The view keeps the edge tier as the cluster's pool and the cloud
tier as its :attr:`~ext_proc.view.ClusterEndpoints.spill`. The rule, per request:

- the request stays on the edge tier while the edge's requests in flight are below
  ``threshold x`` the edge's max concurrency (the sum of its endpoints' ``max_concurrency``);
- at or above it, it goes to the cloud tier (the scheduler then chooses among the cloud endpoints);
- a request no edge endpoint has the memory for (memory admission) goes to the cloud tier too
  (:func:`ext_proc.picker.pick`), rather than waiting for edge memory.

So the edge never holds more than ``ceil(threshold x capacity)`` requests the picker sent there
(60 % by default), and the cloud gets nothing while the edge is under the threshold. An edge tier
without a known max concurrency (an endpoint without ``inferlb.max_concurrency`` metadata) never
spills: its load has no scale. Envoy's own priority levels do the rest when the picker is not
asked: they move traffic to priority 1 only when priority 0 is not healthy enough
(docs/envoy-facts.md, "Priority levels").
"""

from __future__ import annotations

from collections.abc import Mapping

from ext_proc.view import ClusterEndpoints

__all__ = ["tier_for", "tier_load"]


def tier_load(pool: ClusterEndpoints, in_flight: Mapping[str, float]) -> float:
    """Requests in flight on ``pool``'s endpoints over its max concurrency (0-1, above 1 when over;
    0 when its capacity is unknown). ``in_flight``: ``{"HOST:PORT": requests}``, missing = 0."""
    if pool.capacity <= 0:
        return 0.0
    return sum(in_flight.get(e, 0) for e in pool.endpoints) / pool.capacity


def tier_for(pool: ClusterEndpoints, in_flight: Mapping[str, float], threshold: float) -> ClusterEndpoints:
    """The tier of ``pool``'s cluster that takes the next request: ``pool`` (the edge), or its
    ``spill`` (the cloud) when the edge's load (:func:`tier_load`) is >= ``threshold`` (0-1].

    >>> from ext_proc.ring import HashRing
    >>> cloud = ClusterEndpoints("c", ("10.0.1.1:80",), HashRing(("10.0.1.1:80",), 4), 8)
    >>> edge = ClusterEndpoints("c", ("10.0.0.1:80",), HashRing(("10.0.0.1:80",), 4), 10, spill=cloud)
    >>> [tier_for(edge, {"10.0.0.1:80": n}, 0.6) is cloud for n in (5, 6)]
    [False, True]
    """
    spill = pool.spill
    if spill is None or not spill.endpoints or pool.capacity <= 0:
        return pool
    return spill if tier_load(pool, in_flight) >= threshold else pool
