"""``queue``: ``1 / (1 + queue / half_at)`` — 1 with an empty queue, 0.5 at ``half_at`` waiting
requests (default: the endpoint's ``max_concurrency``), towards 0 as the queue grows."""

from __future__ import annotations

from pydantic import Field

from tests.support.reference_engine.plugin import ClusterRound, Member, PluginParams, clamp01, per_endpoint_scorer


class Params(PluginParams):
    """``half_at``: queue length (requests) that scores 0.5; ``None`` = the endpoint's max_concurrency."""

    half_at: float | None = Field(None, gt=0)


def _score(m: Member, p: Params, rnd: ClusterRound) -> float | None:
    q = m.stats.queue
    if q is None:
        return None
    half = p.half_at if p.half_at is not None else float(m.spec.max_concurrency)
    return clamp01(1.0 / (1.0 + max(0.0, q) / half))


PLUGIN = per_endpoint_scorer("queue", Params, 0.5, _score)
