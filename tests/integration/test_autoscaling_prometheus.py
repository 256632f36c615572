"""The autoscaling signal through real Prometheus: scraped from inferlb's /metrics with its help text,
and returned by the prometheus-adapter rule's query and the KEDA trigger's query of
deploy/kubernetes/autoscaling, following the live load (requests held at the backends)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from inferlb.devstack import stack
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until
from xds_server.admin.exposition import AUTOSCALING

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "autoscaling"


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Iterator[tuple[Stack, str]]:
    """Two v1 backends of max concurrency 2 (capacity 4), target saturation 0.7; a Prometheus that
    scrapes inferlb's admin port every second."""
    s = start_stack(tmp_path_factory.mktemp("autoscaling"), [("v1", "a100"), ("v1", "a100")],
                    config={"autoscaling": {"target_saturation": 0.7},
                            "services": [{"versions": [{"endpoints": [{"max_concurrency": 2},
                                                                      {"max_concurrency": 2}]}]}]})
    port = stack.free_port()
    try:
        prom = stack.start_prometheus([f"127.0.0.1:{s.app.admin_port}"], s.workdir / "prom-admin", port, 1.0)
    except BaseException:
        stop_stack(s)
        raise
    s.procs.append(prom)
    yield s, f"http://127.0.0.1:{port}"
    stop_stack(s)


def query(prom: str, promql: str) -> dict[str, float]:
    """``{cluster label: value}`` of an instant query."""
    doc = requests.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert doc["status"] == "success", doc
    return {r["metric"].get("cluster", ""): float(r["value"][1]) for r in doc["data"]["result"]}


def adapter_query(metric: str, match_labels: dict[str, str]) -> str:
    """What prometheus-adapter runs for an External metric of the rule serving ``metric``: its
    ``metricsQuery`` with ``<<.Series>>`` the series and ``<<.LabelMatchers>>`` the HPA's selector."""
    config = yaml.safe_load(yaml.safe_load((EXAMPLES / "prometheus-adapter.yaml").read_text())["data"]["config.yaml"])
    (rule,) = [r for r in config["externalRules"] if r["name"]["as"] == metric]
    matchers = ",".join(f'{k}="{v}"' for k, v in sorted(match_labels.items()))
    return rule["metricsQuery"].replace("<<.Series>>", metric).replace("<<.LabelMatchers>>", matchers)


def keda_query() -> str:
    doc = yaml.safe_load((EXAMPLES / "keda-scaledobject.yaml").read_text())
    return doc["spec"]["triggers"][0]["metadata"]["query"]


def test_prometheus_scrapes_every_family_with_its_help(scaled):
    _, prom = scaled
    for name, help_text in AUTOSCALING.items():
        if name == "inferlb_cluster_queue_wait_seconds":
            continue   # absent while the backends report no throughput (never a fake 0)
        meta = wait_until(lambda n=name: requests.get(f"{prom}/api/v1/metadata", params={"metric": n},
                                                      timeout=5).json()["data"].get(n), 20, 0.5, f"{name} scraped")
        assert meta[0]["type"] == "gauge" and meta[0]["help"] == help_text


def test_the_adapter_and_keda_queries_follow_the_live_load(scaled):
    s, prom = scaled
    metric = yaml.safe_load((EXAMPLES / "hpa.yaml").read_text())["spec"]["metrics"][0]["external"]["metric"]
    hpa = adapter_query(metric["name"], metric["selector"]["matchLabels"])
    wait_until(lambda: query(prom, hpa) == {"chat-v1": 0.0}, 20, 0.5, "an idle cluster's suggestion of 0")
    assert query(prom, 'inferlb_cluster_replicas{cluster="chat-v1"}') == {"chat-v1": 2.0}
    for b in s.backends:
        b.fault(hang=True)
    held = [threading.Thread(target=lambda: requests.post(f"{s.listener}/v1/chat/completions", json={
        "max_tokens": 8, "messages": []}, timeout=40), daemon=True) for _ in range(4)]
    try:
        for t in held:
            t.start()
        # 4 in flight over a capacity of 4: saturation 1; ceil(2 x 1.0 / 0.7) = 3 replicas.
        wait_until(lambda: query(prom, hpa) == {"chat-v1": 3.0}, 30, 0.5, "the adapter query to suggest 3")
        assert query(prom, keda_query()) == {"": 3.0}   # max() without by: no label left
        assert query(prom, adapter_query("inferlb_cluster_saturation_ratio", {"cluster": "chat-v1"})) == {
            "chat-v1": 1.0}
    finally:
        for b in s.backends:
            b.fault(reset=True)
        for t in held:
            t.join(40)
    wait_until(lambda: query(prom, hpa) == {"chat-v1": 0.0}, 30, 0.5, "the suggestion back to 0")
