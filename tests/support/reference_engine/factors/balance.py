"""``balance``: nudges each endpoint's share of the requests toward its target share.

The idea of the load-balancing term in mixture-of-experts routing: the Switch Transformer's auxiliary
loss penalises experts that get more than their share of tokens (Fedus et al., 2021,
arXiv:2101.03961), and DeepSeek-V3's auxiliary-loss-free variant adds a per-expert bias that moves by
a fixed step ``gamma`` each step toward balance (Wang et al., 2024, arXiv:2408.15664). Here each
endpoint carries a bias ``b`` (log of its multiplier): target share ``t`` = its weight so far over the
pool's, actual share ``a`` = its ``request_rate`` over the pool's; when ``|t - a| > tolerance x t``,
``b += step x sign(t - a)``, bounded to ``±ln(max_factor)``. The multiplier is ``exp(b)``. Inert while
the pool serves less than ``min_rps`` requests per second or any endpoint's rate is unknown; an
endpoint that leaves the pool forgets its bias. Useful where something other than the weights steers
traffic (session pinning, Envoy's least-request choice).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import Field

from tests.support.reference_engine.plugin import ClusterRound, Factor, PluginParams, State


class Params(PluginParams):
    """``step``: bias change per round; ``max_factor``: multiplier bound (>= 1); ``min_rps``: traffic
    needed to act (req/s); ``tolerance``: relative dead band around the target share."""

    step: float = Field(0.02, ge=0, le=1)
    max_factor: float = Field(2.0, ge=1)
    min_rps: float = Field(1.0, ge=0)
    tolerance: float = Field(0.1, ge=0)


def _run(rnd: ClusterRound, p: Params, state: State, weights: Mapping[str, float]
         ) -> tuple[Mapping[str, float], State]:
    bias = {m.address: float(state.get(m.address, 0.0)) for m in rnd.members}
    rates = {m.address: m.stats.request_rate for m in rnd.members}
    total_w = sum(weights.get(a, 0.0) for a in bias)
    known = [r for r in rates.values() if r is not None]
    total_r = sum(max(0.0, r) for r in known)
    usable = math.isfinite(total_r) and math.isfinite(total_w) and total_w > 0
    if usable and len(known) == len(rates) and len(rates) > 1 and total_r >= max(p.min_rps, 1e-9):
        bound = math.log(p.max_factor)
        for a in bias:
            target = weights.get(a, 0.0) / total_w
            actual = max(0.0, rates[a] or 0.0) / total_r
            if abs(target - actual) > p.tolerance * target:
                bias[a] = max(-bound, min(bound, bias[a] + p.step * math.copysign(1.0, target - actual)))
    return {a: math.exp(b) for a, b in bias.items()}, {a: b for a, b in bias.items() if b != 0.0}
PLUGIN = Factor("balance", Params, _run)
