"""``idle_compute``: ``1 - GPU utilisation`` (the busiest GPU of the endpoint), 0–1."""

from __future__ import annotations

from tests.support.reference_engine.plugin import ClusterRound, Member, NoParams, clamp01, per_endpoint_scorer


def _score(m: Member, _: NoParams, rnd: ClusterRound) -> float | None:
    return None if m.stats.gpu_util is None else clamp01(1.0 - m.stats.gpu_util)


PLUGIN = per_endpoint_scorer("idle_compute", NoParams, 1.0, _score)
