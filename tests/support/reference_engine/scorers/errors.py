"""``errors``: ``1 - error_rate / tolerance`` (0–1): 1 without errors, 0 at ``tolerance`` (default 20 %)
of requests answered 5xx (an OOM is one). The worse of the backend's and Envoy's view counts."""

from __future__ import annotations

from pydantic import Field

from tests.support.reference_engine.plugin import ClusterRound, Member, PluginParams, clamp01, per_endpoint_scorer


class Params(PluginParams):
    """``tolerance``: error rate (0–1] that scores 0."""

    tolerance: float = Field(0.2, gt=0, le=1)


def _score(m: Member, p: Params, rnd: ClusterRound) -> float | None:
    rates = [r for r in (m.stats.error_rate, m.stats.client_error_rate) if r is not None]
    return None if not rates else clamp01(1.0 - max(rates) / p.tolerance)


PLUGIN = per_endpoint_scorer("errors", Params, 1.0, _score)
