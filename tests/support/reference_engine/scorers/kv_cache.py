"""``kv_cache``: ``1 - KV-cache usage`` (0–1): a nearly full cache means preemptions and recompute."""

from __future__ import annotations

from tests.support.reference_engine.plugin import ClusterRound, Member, NoParams, clamp01, per_endpoint_scorer


def _score(m: Member, _: NoParams, rnd: ClusterRound) -> float | None:
    return None if m.stats.kv_cache is None else clamp01(1.0 - m.stats.kv_cache)


PLUGIN = per_endpoint_scorer("kv_cache", NoParams, 0.5, _score)
