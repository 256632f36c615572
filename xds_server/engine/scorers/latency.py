"""``latency``: the pool's best latency over the endpoint's own, in (0, 1] — bounded, never the
unbounded ``1000 / (latency + 1)`` kind.

``signal``: ``mean`` (default) or ``p95``; Envoy's client-side view is used when a source provides
it. With ``normalize_by_capacity`` (default) latencies are multiplied by the GPU-class capacity
first: the capacity factor already gives an A10 less traffic for being slower, so its expected
slowness must not be penalised twice. No data, or no peer with data: ``None``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from xds_server.engine.inputs import latency_of
from xds_server.engine.plugin import Array, ClusterRound, PluginParams, Scorer, State, score_where


class Params(PluginParams):
    """See the module docstring."""

    signal: Literal["mean", "p95"] = "mean"
    normalize_by_capacity: bool = True


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Array, State]:
    """O(n): the pool's best latency is found once per round, not once per endpoint."""
    v = latency_of(rnd, p.signal)
    if p.normalize_by_capacity:
        v = v * rnd.columns.capacity
    known = (v > 0) & np.isfinite(v)
    if not known.any():
        return np.full(len(v), np.nan), state
    return score_where(known, np.min(v[known]) / np.where(known, v, 1.0)), state


PLUGIN = Scorer("latency", Params, 1.0, _run)
