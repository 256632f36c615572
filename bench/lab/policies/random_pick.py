"""``random``: a uniformly random HEALTHY endpoint of the request's cluster (the floor).

llm-d's blog (2025-09-24) measures it as its first baseline ("random"): TTFT p90 92.6 s at their
highest load. Weights are ignored (as Envoy's ``RANDOM`` load balancer: "selects a random
available host", Envoy docs, arch_overview/upstream/load_balancing/load_balancers).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Request

__all__ = ["RandomPick"]


class RandomPick(ProxyPolicy):
    """Uniform random choice among the cluster's HEALTHY endpoints (the run's seeded generator)."""

    name = "random"

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        return endpoints[self.ctx.rng.randrange(len(endpoints))]
