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

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, Factor, PluginParams, State


class Params(PluginParams):
    """``step``: bias change per round; ``max_factor``: multiplier bound (>= 1); ``min_rps``: traffic
    needed to act (req/s); ``tolerance``: relative dead band around the target share."""

    step: float = Field(0.02, ge=0, le=1)
    max_factor: float = Field(2.0, ge=1)
    min_rps: float = Field(1.0, ge=0)
    tolerance: float = Field(0.1, ge=0)


def _run(rnd: ClusterRound, p: Params, state: State, weights: Array) -> tuple[Array, State]:
    n = len(rnd.addresses)
    bias = np.zeros(n)
    if state:
        members = rnd.index()
        for address, b in state.items():
            if address in members:
                bias[members[address]] = float(b)
    rates = rnd.stat("request_rate")
    known = ~np.isnan(rates)
    # Sums in member order, one addition at a time (Python's ``sum``), as the shares were always computed.
    total_w = sum(weights.tolist())
    total_r = sum(np.maximum(0.0, rates[known]).tolist())
    usable = math.isfinite(total_r) and math.isfinite(total_w) and total_w > 0
    if usable and known.all() and n > 1 and total_r >= max(p.min_rps, 1e-9):
        bound = math.log(p.max_factor)
        target = weights / total_w
        actual = np.maximum(0.0, rates) / total_r
        moves = np.abs(target - actual) > p.tolerance * target
        bias = np.where(moves, np.clip(bias + p.step * np.copysign(1.0, target - actual), -bound, bound), bias)
    kept = np.flatnonzero(bias != 0.0).tolist()
    # math.exp, not np.exp: the multipliers stay bit-for-bit those of the C library's exp.
    return (np.array(list(map(math.exp, bias.tolist()))),
            {rnd.addresses[i]: b for i, b in zip(kept, bias[kept].tolist(), strict=True)})
PLUGIN = Factor("balance", Params, _run)
