"""``max_concurrency``: excludes an endpoint whose running requests (window average) reached its
configured ``max_concurrency``."""

from __future__ import annotations

from xds_server.engine.plugin import ClusterRound, Member, NoParams, per_endpoint_filter


def _check(m: Member, _: NoParams, rnd: ClusterRound) -> str | None:
    running = m.stats.running
    if running is not None and running >= m.spec.max_concurrency:
        return f"running {running:.1f} >= max concurrency {m.spec.max_concurrency}"
    return None


PLUGIN = per_endpoint_filter("max_concurrency", NoParams, _check)
