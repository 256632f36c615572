"""The ADS server against a real Envoy, fed hand-built snapshots (cases C01, C02, C03, C15).

No Prometheus and no picker here: the snapshot is the input, Envoy's admin API the output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import duration_pb2

from xds_server import stack
from xds_server.ads.cache import SnapshotCache
from xds_server.ads.server import start_ads_server
from xds_server.bootstrap import render_bootstrap
from xds_server.config import Config, parse_config
from xds_server.control import endpoint_specs
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EngineParams, EngineState
from xds_server.envoy_admin import envoy_hosts, envoy_stat
from xds_server.metrics.stats import EndpointStats
from xds_server.snapshot import CLUSTER_TYPE, TYPE_ORDER, Snapshot, build_snapshot, make_snapshot

from .conftest import LoopThread, wait_until

pytestmark = pytest.mark.integration


def unpack(res):
    """A snapshot Resource back to its message."""
    from google.protobuf import symbol_database

    msg = symbol_database.Default().GetSymbol(res.packed.TypeName())()
    res.packed.Unpack(msg)
    return msg


@dataclass
class Harness:
    loop: LoopThread
    cache: SnapshotCache
    servicer: object
    envoy: stack.Proc
    admin: str
    listener: str
    backends: list[str]

    def push(self, snap: Snapshot) -> None:
        self.loop.run(self.cache.set(snap))

    def node(self) -> dict:
        return next(n for n in self.servicer.describe_nodes() if n["node_id"] == "ads-test")

    def get(self, path: str = "/v1/completions"):
        import requests

        return requests.post(f"{self.listener}{path}", json={"max_tokens": 4}, timeout=5)


LISTENER = 0  # set by the fixture: Envoy's listener port
EXT_PROC = "127.0.0.1:1"  # nothing listens there: the ext_proc filter fails open to the default route


def config(backends: list[str], *, connect_timeout_s: float = 1.0, with_v2: bool = True) -> Config:
    versions = [{"name": "v1", "endpoints": [{"address": a} for a in backends[:2]]}]
    if with_v2:
        versions.append({"name": "v2", "endpoints": [{"address": backends[2]}]})
    return parse_config(yaml.safe_dump({
        "envoy": {"listener": f"127.0.0.1:{LISTENER}"},
        "services": [{"name": "chat", "connect_timeout_s": connect_timeout_s, "versions": versions}],
    }))


def snapshot_for(cfg: Config) -> Snapshot:
    weights, _ = compute_weights(endpoint_specs(cfg), {}, EngineState(), EngineParams())
    return build_snapshot(cfg, weights, EXT_PROC)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Iterator[Harness]:
    global LISTENER
    LISTENER = stack.free_port()
    work: Path = tmp_path_factory.mktemp("ads")
    procs = []
    loop = LoopThread()
    try:
        backends = []
        for v in ("v1", "v1", "v2"):
            port = stack.free_port()
            procs.append(stack.start_sim(port, work, gpu_class="a100", version=v, extra=["--time-scale", "0.1"]))
            backends.append(f"127.0.0.1:{port}")
        cache = SnapshotCache()
        server, servicer, xds_port = loop.run(start_ads_server(cache, "127.0.0.1:0"))
        cfg = config(backends)
        loop.run(cache.set(snapshot_for(cfg)))
        admin_port = stack.free_port()
        envoy = stack.start_envoy(render_bootstrap(xds_address=f"127.0.0.1:{xds_port}", node_id="ads-test",
                                                   admin_port=admin_port), work, admin_port)
        procs.append(envoy)
        admin = f"http://127.0.0.1:{admin_port}"
        stack.wait_http(f"{admin}/ready", envoy, timeout=20)
        yield Harness(loop, cache, servicer, envoy, admin, f"http://127.0.0.1:{LISTENER}", backends)
        loop.run(server.stop(0))
    finally:
        for p in reversed(procs):
            p.stop()
        loop.close()


def test_cds_change_with_same_endpoints_does_not_stall_warming(harness: Harness):
    """C01: a changed cluster definition is active again within 1 s (no 15 s warming wait)."""
    modified = envoy_stat(harness.admin, "cluster_manager.cluster_modified") or 0
    harness.push(snapshot_for(config(harness.backends, connect_timeout_s=2.5)))
    wait_until(lambda: (envoy_stat(harness.admin, "cluster_manager.cluster_modified") or 0) > modified, 2, 0.02,
               "Envoy to apply the changed cluster")
    t0 = time.monotonic()
    wait_until(lambda: envoy_stat(harness.admin, "cluster_manager.warming_clusters") == 0, 1.0, 0.02,
               "warming_clusters back to 0")
    assert time.monotonic() - t0 < 1.0
    for _ in range(10):
        assert harness.get().status_code == 200


def test_tiny_scores_never_send_weight_zero(harness: Harness):
    """C02: 150 endpoints with zero scores: every weight >= 1 and Envoy ACKs (no NACK)."""
    many = [f"127.0.0.2:{20000 + i}" for i in range(150)]
    cfg = parse_config(yaml.safe_dump({"services": [{"name": "chat", "versions": [
        {"name": "v1", "endpoints": [{"address": a} for a in harness.backends[:2]]},
        {"name": "v2", "endpoints": [{"address": a, "max_concurrency": 1} for a in many]},
    ]}]}))
    specs = endpoint_specs(cfg)
    worst = EndpointStats(latency_mean_ms=1e9, running=0.99, gpu_util=1.0, queue=1e6, sample_age_s=0.1)
    stats = {s.instance: worst for s in specs}
    stats[harness.backends[0]] = EndpointStats(latency_mean_ms=1, running=0, gpu_util=0, sample_age_s=0.1)
    weights, _ = compute_weights(specs, stats, EngineState(), replace(EngineParams(), max_weight=1))
    nacks = harness.node()["types"]["ClusterLoadAssignment"]["nacks"]
    harness.push(build_snapshot(cfg, weights, EXT_PROC))
    hosts = wait_until(lambda: (h := envoy_hosts(harness.admin).get("chat-v2", {})) and len(h) == 150 and h,
                       3, 0.05, "150 hosts in Envoy")
    assert all(h["weight"] >= 1 for h in hosts.values())
    assert harness.node()["types"]["ClusterLoadAssignment"]["nacks"] == nacks
    harness.push(snapshot_for(config(harness.backends)))
    wait_until(lambda: len(envoy_hosts(harness.admin).get("chat-v2", {})) == 1, 3, 0.05, "v2 restored")


def test_nacked_config_keeps_last_good_and_is_not_resent(harness: Harness):
    """C03: Envoy rejects a cluster; the last good config serves, the NACK is visible, no resend loop."""
    good = snapshot_for(config(harness.backends))
    harness.push(good)
    bad_cluster = cluster_pb2.Cluster()
    good.of(CLUSTER_TYPE)["chat-v1"].packed.Unpack(bad_cluster)
    bad_cluster.connect_timeout.CopyFrom(duration_pb2.Duration(seconds=-5))  # Envoy: must be > 0
    messages = {t: {n: unpack(r) for n, r in good.of(t).items()} for t in TYPE_ORDER}
    messages[CLUSTER_TYPE]["chat-v1"] = bad_cluster
    before = harness.node()["types"]["Cluster"]
    harness.push(make_snapshot(messages))
    after = wait_until(lambda: (t := harness.node()["types"]["Cluster"])["nacks"] > before["nacks"] and t,
                       3, 0.05, "a NACK")
    assert "Expected positive duration" in (after["last_nack"] or ""), after["last_nack"]
    assert after["acked_version"] == before["acked_version"]
    for _ in range(10):
        assert harness.get().status_code == 200
    time.sleep(1.5)
    assert harness.node()["types"]["Cluster"]["nacks"] == after["nacks"], "the rejected version was re-sent"
    harness.push(snapshot_for(config(harness.backends, connect_timeout_s=1.5)))
    wait_until(lambda: (t := harness.node()["types"]["Cluster"])["acked_version"] == t["sent_version"], 3, 0.05,
               "the next good change to be ACKed")


def test_removed_then_readded_cluster_gets_its_endpoints(harness: Harness):
    """C15: a service version removed and added back is served again (EDS sent for it)."""
    harness.push(snapshot_for(config(harness.backends, with_v2=False)))
    wait_until(lambda: "chat-v2" not in envoy_hosts(harness.admin), 3, 0.05, "chat-v2 removed")
    harness.push(snapshot_for(config(harness.backends)))
    hosts = wait_until(lambda: envoy_hosts(harness.admin).get("chat-v2"), 3, 0.05, "chat-v2 back with hosts")
    assert list(hosts) == [harness.backends[2]]
    wait_until(lambda: envoy_stat(harness.admin, "cluster.chat-v2.membership_healthy") == 1, 3, 0.05,
               "chat-v2's endpoint healthy")
