"""``slow_start``: a new endpoint ramps from a low weight to full.

As Envoy's slow start (https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/load_balancing/slow_start):
factor ``max(min_weight_percent / 100, (t / window_s) ^ (1 / aggression))`` where ``t`` is the time since
the endpoint became eligible. The ramp ends after ``window_s``, or earlier once the endpoint served
``requests`` successful requests (``success_total`` grew by that much; 0 = time only). It starts when an
endpoint joins a cluster the engine already decided, or comes back after being excluded (stale,
ejected, filtered); the endpoints of the very first round start at full weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from tests.support.reference_engine.plugin import ClusterRound, Factor, PluginParams, State


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


def _run(rnd: ClusterRound, p: Params, state: State, weights: Mapping[str, float]
         ) -> tuple[Mapping[str, float], State]:
    out: dict[str, float] = {}
    new: dict[str, Ramp] = {}
    done = _DONE
    for m in rnd.members:
        r = state.get(m.address)
        if r is None:
            r = done if rnd.first_round or p.window_s == 0 else Ramp(rnd.now, m.stats.success_total)
        if r.started is None:  # at full weight: the common case, one dict write each
            out[m.address] = 1.0
            new[m.address] = r
            continue
        if r.started is not None:
            elapsed = max(0.0, rnd.now - r.started)
            served = (None if r.base_success is None or m.stats.success_total is None
                      else m.stats.success_total - r.base_success)
            if elapsed >= p.window_s or (p.requests > 0 and served is not None and served >= p.requests):
                r = done
        if r.started is None:
            out[m.address] = 1.0
        else:
            t = max(0.0, rnd.now - r.started) / p.window_s
            out[m.address] = max(p.min_weight_percent / 100.0, t ** (1.0 / p.aggression))
        new[m.address] = r
    return out, new


_DONE = Ramp(None)
PLUGIN = Factor("slow_start", Params, _run)
