"""The Grafana dashboard and its compose provisioning: every query names metrics inferlb exposes,
the panels an operator needs are there, and docker-compose.yml mounts what Grafana loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

import inferlb.serve  # noqa: F401  (registers every module-level metric, as `inferlb serve` does)
from tests.unit.xds_server.test_metrics_exposition import NODES, VERSIONS, WEIGHTS
from xds_server.admin.exposition import EndpointCollector, NodeCollector

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "dashboards" / "inferlb.json"


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard (panels and template variables)."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] if p["type"] != "row" for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return exprs


def exposed_sample_names() -> set[str]:
    names = set()
    families = [*REGISTRY.collect(), *EndpointCollector(lambda: WEIGHTS).collect(),
                *NodeCollector(lambda: NODES, lambda: VERSIONS).collect()]
    for f in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(f.type, [""])
        names |= {f.name + s for s in suffixes}
    return names


def test_every_query_names_only_exposed_metrics():
    exposed = exposed_sample_names()
    used = {m for e in dashboard_exprs() for m in re.findall(r"\binferlb_[a-z0-9_]+", e)}
    assert used and used <= exposed, sorted(used - exposed)


def test_the_panels_operators_need_are_there():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "inferlb"
    exprs = " ".join(dashboard_exprs())
    for metric in ("inferlb_endpoint_weight", "inferlb_endpoint_health", "inferlb_endpoint_latency_mean_seconds",
                   "inferlb_endpoint_gpu_utilization_ratio", "inferlb_ext_proc_decisions_total",
                   "inferlb_ext_proc_decision_seconds_bucket", "inferlb_xds_node_in_sync",
                   "inferlb_xds_responses_total"):
        assert metric in exprs, metric
    assert 'status="DRAINING"' in exprs and 'status="UNHEALTHY"' in exprs  # ejections and drains
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    cells = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area


def test_compose_provisions_prometheus_and_grafana_with_the_dashboard():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert "./dashboards" in mounts and DASHBOARD.parent == ROOT / "dashboards"
    provisioning = ROOT / "deploy" / "compose" / "grafana" / "provisioning"
    assert mounts["./deploy/compose/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "inferlb.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == mounts["./dashboards"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    inferlb_ip = compose["services"]["inferlb"]["networks"]["mesh"]["ipv4_address"]
    assert f"{inferlb_ip}:18090" in targets
