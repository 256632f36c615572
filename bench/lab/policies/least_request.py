"""``least_request``: Envoy's ``LEAST_REQUEST`` load balancer on its own active requests.

Source: Envoy docs (arch_overview/upstream/load_balancing/load_balancers, "Weighted least request",
v1.3x) and ``LeastRequestLbConfig``: with all weights equal, "an O(1) algorithm which selects N
random available hosts as specified in the configuration (2 by default) and picks the host which
has the fewest active requests" (the power of two choices, Mitzenmacher 2001; ties: the first
drawn); with unequal weights, "a weighted round robin schedule in which weights are dynamically
adjusted based on the host's request load at the time of selection":
``weight / (active_requests + 1) ^ active_request_bias``, ``active_request_bias`` default 1.0.
Active requests are this Envoy's own (``rq_active``: sent, response not yet ended).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.lab.policies.edf import Edf
from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Request

__all__ = ["LeastRequest"]


class LeastRequest(ProxyPolicy):
    """Envoy's least request.

    Args:
        choice_count: hosts drawn per pick with equal weights (Envoy's default 2).
        active_request_bias: the exponent of the load adjustment with unequal weights (default 1.0).
    """

    name = "least_request"

    def __init__(self, choice_count: int = 2, active_request_bias: float = 1.0) -> None:
        super().__init__()
        if choice_count < 1 or active_request_bias < 0:
            raise ValueError(f"least_request: choice_count >= 1 and active_request_bias >= 0 needed, got "
                             f"{choice_count}, {active_request_bias}")
        self.choice_count = choice_count
        self.bias = active_request_bias
        self._schedules: dict[str, tuple[tuple[Endpoint, ...], Edf]] = {}

    def _adjusted(self, weights: dict[str, int]):
        active, bias = self.active, self.bias
        return lambda a: weights[a] / (active.get(a, 0) + 1) ** bias

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        rng = self.ctx.rng
        if len({e.weight for e in endpoints}) > 1:
            kept = self._schedules.get(cluster)
            if kept is None or kept[0] != tuple(endpoints):
                weights = {e.address: e.weight for e in endpoints}
                kept = self._schedules[cluster] = (tuple(endpoints),
                                                   Edf(list(weights), self._adjusted(weights), rng))
            chosen = kept[1].pick()
            return next(e for e in kept[0] if e.address == chosen)
        best, low = endpoints[0], None
        for _ in range(self.choice_count):
            e = endpoints[rng.randrange(len(endpoints))]
            n = self.active.get(e.address, 0)
            if low is None or n < low:
                best, low = e, n
        return best
