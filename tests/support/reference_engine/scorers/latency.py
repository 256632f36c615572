"""``latency``: the pool's best latency over the endpoint's own, in (0, 1] — bounded, never the
unbounded ``1000 / (latency + 1)`` kind.

``signal``: ``mean`` (default) or ``p95``; Envoy's client-side view is used when a source provides
it. With ``normalize_by_capacity`` (default) latencies are multiplied by the GPU-class capacity
first: the capacity factor already gives an A10 less traffic for being slower, so its expected
slowness must not be penalised twice. No data, or no peer with data: ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from tests.support.reference_engine.inputs import latency_of
from tests.support.reference_engine.plugin import ClusterRound, Member, PluginParams, Scorer, State, clamp01


class Params(PluginParams):
    """See the module docstring."""

    signal: Literal["mean", "p95"] = "mean"
    normalize_by_capacity: bool = True


def _norm(m: Member, p: Params) -> float | None:
    v = latency_of(m, p.signal)
    v = None if v is None else v * (m.spec.capacity if p.normalize_by_capacity else 1.0)
    return v if v is not None and v > 0 and math.isfinite(v) else None


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, float | None], State]:
    """O(n): the pool's best latency is found once per round, not once per endpoint."""
    own = {m.address: _norm(m, p) for m in rnd.members}
    best = min((v for v in own.values() if v is not None), default=None)
    if best is None:
        return dict.fromkeys(own), state
    return {a: None if v is None else clamp01(best / v) for a, v in own.items()}, state


PLUGIN = Scorer("latency", Params, 1.0, _run)
