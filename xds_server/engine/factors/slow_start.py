"""``slow_start``: a new endpoint ramps from a low weight to full.

As Envoy's slow start (https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/load_balancing/slow_start):
factor ``max(min_weight_percent / 100, (t / window_s) ^ (1 / aggression))`` where ``t`` is the time since
the endpoint became eligible. The ramp ends after ``window_s``, or earlier once the endpoint served
``requests`` successful requests (``success_total`` grew by that much; 0 = time only). It starts when an
endpoint joins a cluster the engine already decided, or comes back after being excluded (stale,
ejected, filtered); the endpoints of the very first round start at full weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, Factor, PluginParams, State


class Params(PluginParams):
    """See the module docstring (``window_s`` s; ``min_weight_percent`` 0–100; ``aggression`` > 0)."""

    window_s: float = Field(30.0, ge=0)
    min_weight_percent: float = Field(10.0, gt=0, le=100)
    aggression: float = Field(1.0, gt=0)
    requests: int = Field(0, ge=0)


@dataclass(frozen=True, slots=True)
class Ramp:
    """``started``: when the ramp began (s), ``None`` once at full weight; ``base_success``: success_total then."""

    started: float | None
    base_success: float | None = None


def _run(rnd: ClusterRound, p: Params, state: State, weights: Array) -> tuple[Array, State]:
    done = _DONE
    out = np.ones(len(rnd.addresses))
    new: dict[str, Ramp] = dict.fromkeys(rnd.addresses, done)  # at full weight: the common case
    get = state.get
    for i in [i for i, a in enumerate(rnd.addresses) if get(a) is not done]:
        address = rnd.addresses[i]
        success = rnd.value("success_total", i)
        r = state.get(address)
        if r is None:
            r = done if rnd.first_round or p.window_s == 0 else Ramp(rnd.now, success)
        if r.started is not None:
            elapsed = max(0.0, rnd.now - r.started)
            served = None if r.base_success is None or success is None else success - r.base_success
            if elapsed >= p.window_s or (p.requests > 0 and served is not None and served >= p.requests):
                r = done
        if r.started is not None:
            t = max(0.0, rnd.now - r.started) / p.window_s
            out[i] = max(p.min_weight_percent / 100.0, t ** (1.0 / p.aggression))
        new[address] = r
    return out, new


_DONE = Ramp(None)
PLUGIN = Factor("slow_start", Params, _run)
