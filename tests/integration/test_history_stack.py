"""Weight history, /metrics, the decision sample and the dashboard's queries on a real stack:
simulated GPUs -> real Prometheus -> inferlb -> real Envoy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until
from xds_server.history.sqlite import SqliteHistory

pytestmark = pytest.mark.integration
DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "inferlb.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("history"), [("v1", "a100"), ("v1", "a10"), ("v2", "a100")])
    yield s
    for b in s.backends:
        b.fault(reset=True)
    stop_stack(s)


def history(s: Stack, **params: str) -> dict:
    r = requests.get(f"{s.admin}/api/v1/history", params={"since": "5m", **params}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def points(s: Stack, cluster: str, endpoint: str) -> list[dict]:
    series = history(s, cluster=cluster, endpoint=endpoint)["series"]
    return series[0]["points"] if series else []


def test_every_endpoint_is_recorded_and_an_ejection_is_a_change_with_its_reason(stack: Stack):
    s = stack
    wait_until(lambda: len(history(s)["series"]) == 3, 10, 0.2, "a history series per endpoint")
    target = s.backends[0]
    target.fault(metrics="error")
    wait_until(lambda: any(p["health"] == "UNHEALTHY" for p in points(s, "chat-v1", target.address)), 25, 0.3,
               "an UNHEALTHY row for the backend whose metrics stopped")
    target.fault(reset=True)
    wait_until(lambda: points(s, "chat-v1", target.address)[-1]["health"] == "HEALTHY", 20, 0.3,
               "a HEALTHY row once its metrics are back")

    rows = points(s, "chat-v1", target.address)
    ejected = next(p for p in rows if p["health"] == "UNHEALTHY")
    assert any("stale" in r for r in ejected["reasons"]) and ejected["kind"] == "change"
    assert set(ejected["inputs"]) >= {"latency_mean_ms", "gpu_util", "sample_age_s"}
    changes = [p for p in rows if p["kind"] == "change"]
    for before, after in zip(changes, changes[1:], strict=False):
        assert (before["weight"], before["health"]) != (after["weight"], after["health"]), (before, after)

    # the rows are on disk, readable by a second connection while inferlb runs (WAL)
    disk = SqliteHistory(s.workdir / "history.sqlite3", retention_s=86400, max_rows=10**6)
    try:
        stored = disk.rows(0, float("inf"), "chat-v1", target.address)
        assert [r.health for r in stored if r.kind == "change"] == [p["health"] for p in changes]
    finally:
        disk.close()


def test_metrics_and_decisions_after_traffic(stack: Stack):
    s = stack
    s.app.sampler.every = 1  # keep every decision for this test
    served = {}
    for i in range(6):
        r = s.send({"x-session-id": f"hist-{i}", "model-version": "v1"})
        assert r.status_code == 200
        served[i] = r.headers["x-served-by"]
    decisions = requests.get(f"{s.admin}/api/v1/decisions", timeout=5).json()["decisions"]
    pinned = [d for d in decisions if d["key"] == "session" and d["endpoint"]]
    assert len(pinned) >= 6 and {d["endpoint"] for d in pinned[:6]} == set(served.values())
    assert all(d["version"] == "v1" and d["cluster"] == "chat-v1" and len(d["session"]) == 16 for d in pinned[:6])

    def families() -> dict | None:
        """The control plane's metric families once the backends' GPU memory is in (Prometheus
        scraped them: on a loaded machine that can come after the first weight rounds)."""
        text = requests.get(f"{s.admin}/metrics", timeout=5).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        gpu = fams.get("inferlb_endpoint_gpu_memory_free_bytes")
        return fams if gpu is not None and any(x.value > 0 for x in gpu.samples) else None

    fams = wait_until(families, 10, 0.2, "the backends' free GPU memory in /metrics")
    weights = {(x.labels["cluster"], x.labels["endpoint"]): x.value for x in fams["inferlb_endpoint_weight"].samples}
    assert set(weights) == {(f"chat-{b.version}", b.address) for b in s.backends} and min(weights.values()) >= 1
    health = {x.labels["status"] for x in fams["inferlb_endpoint_health"].samples if x.value == 1}
    assert health == {"HEALTHY"}
    outcomes = {x.labels["outcome"] for x in fams["inferlb_ext_proc_decisions"].samples if x.value > 0}
    assert "affinity" in outcomes

    def in_sync() -> dict[str, float] | None:
        text = requests.get(f"{s.admin}/metrics", timeout=5).text
        fam = next(f for f in text_string_to_metric_families(text) if f.name == "inferlb_xds_node_in_sync")
        got = {x.labels["type"]: x.value for x in fam.samples if x.labels["node"] == "test-envoy"}
        return got if set(got) == {"Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration"} \
            and all(v == 1 for v in got.values()) else None

    wait_until(in_sync, 5, 0.2, "the node to be in sync with the current snapshot for every type")


def test_dashboard_queries_parse_in_real_prometheus(stack: Stack):
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] if p["type"] != "row" for t in p["targets"]]
    for expr in exprs:
        query = expr.replace("$cluster", ".*").replace("$__rate_interval", "1m")
        r = requests.get(f"{stack.cfg.prometheus.url}/api/v1/query", params={"query": query}, timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
