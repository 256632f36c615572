"""``round_robin``: Envoy's ``ROUND_ROBIN`` load balancer with the EDS weights.

Source: Envoy docs (arch_overview/upstream/load_balancing/load_balancers, "Weighted round robin",
v1.3x): "each available upstream host is selected in round robin order. If weights are assigned
to endpoints in a locality, then a weighted round robin schedule is used, where higher weighted
endpoints will appear more often in the rotation to achieve the effective weighting". Equal
weights: a plain rotation from a random starting index; unequal: the earliest-deadline-first
schedule (:class:`~bench.lab.policies.edf.Edf`). The schedule is rebuilt when the cluster's
endpoints, weights or health change (Envoy rebuilds it on a host set update).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.lab.policies.edf import Edf
from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Request

__all__ = ["RoundRobin"]


class RoundRobin(ProxyPolicy):
    """Envoy's weighted round robin, one schedule per cluster."""

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._schedules: dict[str, tuple[tuple[Endpoint, ...], Edf | list[int]]] = {}

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        kept = self._schedules.get(cluster)
        if kept is None or kept[0] != tuple(endpoints):
            weights = {e.address: e.weight for e in endpoints}
            if len(set(weights.values())) > 1:
                schedule: Edf | list[int] = Edf([e.address for e in endpoints], weights.__getitem__, self.ctx.rng)
            else:
                schedule = [self.ctx.rng.randrange(len(endpoints))]
            kept = self._schedules[cluster] = (tuple(endpoints), schedule)
        members, schedule = kept
        if isinstance(schedule, Edf):
            chosen = schedule.pick()
            return next(e for e in members if e.address == chosen)
        index = schedule[0] % len(members)
        schedule[0] = index + 1
        return members[index]
