"""Builders for weight-history tests: rows and engine verdicts with inputs and scores."""

from __future__ import annotations

from xds_server.engine.types import HEALTHY, EndpointWeight
from xds_server.history.types import CHANGE, HistoryRow, RowBatch
from xds_server.metrics.stats import EndpointStats


def row(t: float, endpoint: str = "10.0.0.1:8000", weight: int = 50, health: str = HEALTHY,
        cluster: str = "chat-v1", kind: str = CHANGE) -> HistoryRow:
    """A stored row with a few inputs, scores and a reason."""
    return HistoryRow(t=t, cluster=cluster, endpoint=endpoint, weight=weight, health=health, score=0.5,
                      inputs={"latency_mean_ms": 120.0, "running": 2.0}, scores={"latency": 0.5},
                      reasons=(f"weight {weight}",), kind=kind, snapshot_version="v-test")


def stored(rows: RowBatch) -> list[HistoryRow]:
    """``rows`` as a store reads them back (written to a fresh in-memory store), oldest first."""
    from xds_server.history.sqlite import SqliteHistory

    store = SqliteHistory(":memory:", retention_s=30 * 86400, max_rows=100_000)
    store.append(rows)
    return store.rows(float("-inf"), float("inf"))


def verdict(endpoint: str, weight: int, health: str = HEALTHY, cluster: str = "chat-v1",
            latency_ms: float = 100.0) -> EndpointWeight:
    """An engine verdict with inputs (latency varies freely: inputs alone are no change)."""
    return EndpointWeight(cluster, endpoint, weight, health, 0.5,
                          EndpointStats(latency_mean_ms=latency_ms, running=1.0, sample_age_s=1.0),
                          {"latency": 0.5, "concurrency": None}, (f"score 0.50 -> weight {weight}",))


def admin_app(rows: list[HistoryRow], weights: list[EndpointWeight], sampler=None, cost_model=None,
              ready: bool = False, load_view=None, cfg=None):
    """A real admin application over an in-memory store holding ``rows`` and a control plane whose last
    round gave ``weights`` (its metrics source is never called); ``ready``: as if its first snapshot
    was published (``/readyz`` 200); ``load_view``: the pickers' load table; ``cfg``: the control
    plane's config (default: ``factories.config()``). Returns ``(app, store)``."""

    from tests.support.factories import config, metrics_source
    from xds_server.admin.app import make_admin_app
    from xds_server.ads.server import AdsServicer, SnapshotCache
    from xds_server.control import ControlPlane
    from xds_server.history.sqlite import SqliteHistory

    cache = SnapshotCache()
    cp = ControlPlane(cfg or config(), metrics_source(lambda instances: {}, "prometheus"), cache, [],
                      lambda: "127.0.0.1:1")
    cp.weights = list(weights)
    if ready:
        cp.ready.set()
    store = SqliteHistory(":memory:", retention_s=30 * 86400, max_rows=100_000)
    store.append(RowBatch.of(sorted(rows, key=lambda r: r.t)))
    return make_admin_app(cp, AdsServicer(cache), store, sampler, cost_model=cost_model,
                          load_view=load_view), store


def pin_history_clock(monkeypatch, now: float) -> None:
    """Make the history API's "now" start at ``now`` (the rows' reference time) and run on from there:
    test modules build their rows at import, possibly minutes before their tests run."""
    import time
    from types import SimpleNamespace

    from xds_server.history import query

    start = time.monotonic()
    monkeypatch.setattr(query, "time", SimpleNamespace(time=lambda: now + (time.monotonic() - start)))
