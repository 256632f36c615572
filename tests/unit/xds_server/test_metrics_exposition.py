"""/metrics: the endpoint and node collectors against golden output, and Prometheus naming rules."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import inferlb.serve  # noqa: F401  (registers every module-level metric, as `inferlb serve` does)
from tests.support.history_rows import admin_app
from xds_server.admin.exposition import INPUTS, EndpointCollector, NodeCollector
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight
from xds_server.metrics.stats import EndpointStats

GOLDEN = Path(__file__).parent / "golden" / "metrics.prom"

WEIGHTS = [
    EndpointWeight("chat-v1", "10.0.0.1:8000", 87, HEALTHY, 0.8712,
                   EndpointStats(latency_mean_ms=52.5, latency_p95_ms=140.0, queue=0.5, running=2.25, gpu_util=0.41,
                                 gpu_mem_free_mib=40960.0, gpu_mem_used_mib=40960.0, kv_cache=0.125, sample_age_s=1.5),
                   {"idle_compute": 0.59, "concurrency": 0.75, "latency": 1.0}, ("score 0.87",)),
    EndpointWeight("chat-v1", "10.0.0.2:8000", 12, UNHEALTHY, None, EndpointStats(sample_age_s=31.0), {},
                   ("stale metrics",)),
    EndpointWeight("chat-v2", "10.0.1.1:8000", 40, DRAINING, None, EndpointStats(), {}, ("draining",)),
    EndpointWeight("chat-v2", "10.0.1.2:8000", 20, HEALTHY, 0.5, EndpointStats(latency_mean_ms=80.0),
                   {"idle_compute": None, "concurrency": 0.5, "latency": 0.5}, ("score 0.50",)),
]
VERSIONS = {"Cluster": "c-7", "ClusterLoadAssignment": "e-7", "Listener": "l-1"}
NODES = [{
    "node_id": "envoy-1", "node_cluster": "inferlb", "peer": "ipv4:127.0.0.1:5555", "protocol": "sotw",
    "connected_since": 1.0,
    "types": {
        "Cluster": {"acked_version": "c-7", "sent_version": "c-7", "pending_nonce": None, "last_nack": None,
                    "last_nack_at": None, "acks": 3, "nacks": 0, "subscribed": 0},
        "ClusterLoadAssignment": {"acked_version": "e-6", "sent_version": "e-7", "pending_nonce": None,
                                  "last_nack": "bad weight", "last_nack_at": 2.0, "acks": 5, "nacks": 1,
                                  "subscribed": 2},
        "Listener": {"acked_version": None, "sent_version": "l-1", "pending_nonce": "3", "last_nack": None,
                     "last_nack_at": None, "acks": 0, "nacks": 0, "subscribed": 0},
    },
}]


def exposition() -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EndpointCollector(lambda: WEIGHTS))
    registry.register(NodeCollector(lambda: NODES, lambda: VERSIONS))
    return generate_latest(registry).decode()


def test_exposition_matches_golden_output():
    text = exposition()
    if os.environ.get("INFERLB_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "regenerate with INFERLB_UPDATE_GOLDEN=1 after checking the diff"


def test_every_engine_input_is_exported():
    assert set(INPUTS) == {f.name for f in dataclasses.fields(EndpointStats)}


def test_missing_data_has_no_sample():
    text = exposition()
    assert 'inferlb_endpoint_latency_mean_seconds{cluster="chat-v1",endpoint="10.0.0.2:8000"}' not in text
    assert 'plugin="idle_compute"' in text and 'endpoint="10.0.1.2:8000",plugin="idle_compute"' not in text


@pytest.fixture
async def metrics_text():
    app, store = admin_app([], WEIGHTS)
    async with TestClient(TestServer(app)) as c:
        r = await c.get("/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        yield await r.text()
    store.close()


async def test_metrics_endpoint_names_follow_prometheus_conventions(metrics_text):
    families = {f.name: f for f in text_string_to_metric_families(metrics_text) if f.name.startswith("inferlb_")}
    for required in ("inferlb_endpoint_weight", "inferlb_endpoint_health", "inferlb_endpoint_score",
                     "inferlb_xds_requests", "inferlb_xds_responses", "inferlb_ext_proc_decisions",
                     "inferlb_ext_proc_decision_seconds", "inferlb_history_rows_written"):
        assert required in families, required
    assert families["inferlb_ext_proc_decision_seconds"].type == "histogram"
    for name, family in families.items():
        assert re.fullmatch(r"inferlb_[a-z0-9_]+", name), name
        assert not re.search(r"_(ms|mib|percent|perc)(_|$)", name), f"{name}: use base units (seconds, bytes, ratio)"
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            else:
                assert not sample.name.endswith("_total"), sample.name
    health = [s for s in families["inferlb_endpoint_health"].samples if s.labels["endpoint"] == "10.0.1.1:8000"]
    assert {s.labels["status"]: s.value for s in health} == {"HEALTHY": 0, "UNHEALTHY": 0, "DRAINING": 1}
