"""``concurrency``: headroom ``1 - (running + queue) / max_concurrency`` (window averages), 0–1."""

from __future__ import annotations

from tests.support.reference_engine.plugin import ClusterRound, Member, NoParams, clamp01, per_endpoint_scorer


def _score(m: Member, _: NoParams, rnd: ClusterRound) -> float | None:
    if m.stats.running is None:
        return None
    return clamp01(1.0 - (m.stats.running + (m.stats.queue or 0.0)) / m.spec.max_concurrency)


PLUGIN = per_endpoint_scorer("concurrency", NoParams, 1.0, _score)
