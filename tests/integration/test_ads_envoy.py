"""The ADS server against real Envoys, fed hand-built snapshots, in both protocols.

Two Envoys share one ADS server: ``ads-sotw`` (State-of-the-World, node.cluster ``sotw``) and
``ads-delta`` (delta, node.cluster ``delta``). Each node group has its own listener port (node-specific
config), so every test can address either Envoy. No Prometheus and no picker here: the snapshot is
the input, Envoy's admin API and the backend that answered (``x-served-by``) the output. The picker
address points nowhere, so the ext_proc filter fails open and requests take the weighted fallback.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import pytest
import requests
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import duration_pb2, symbol_database

from inferlb.devstack import stack
from inferlb.devstack.envoy_admin import envoy_hosts
from tests.integration.conftest import LoopThread, wait_until
from tests.support.envoy import envoy_stat
from tests.support.snapshots import make_snapshot
from xds_server.ads.cache import SnapshotCache
from xds_server.ads.server import start_ads_server
from xds_server.config import Config, parse_config
from xds_server.control import endpoint_specs
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight, EngineParams, EngineState
from xds_server.metrics.stats import EndpointStats
from xds_server.resources.bootstrap import render_bootstrap
from xds_server.resources.build import BuildMemo, build_snapshot
from xds_server.snapshot import CLUSTER_TYPE, Snapshot

pytestmark = pytest.mark.integration

PROTOCOLS = ("sotw", "delta")
EXT_PROC = "127.0.0.1:1"  # nothing listens there: the ext_proc filter fails open to the default route


@dataclass
class EnvoyNode:
    protocol: str
    node_id: str
    proc: stack.Proc
    admin: str
    listener_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}/v1/completions"

    def hosts(self, cluster: str = "chat-v1") -> dict[str, dict]:
        return envoy_hosts(self.admin).get(cluster, {})

    def stat(self, name: str) -> int | None:
        return envoy_stat(self.admin, name)


@dataclass
class Harness:
    loop: LoopThread
    cache: SnapshotCache
    servicer: object
    server: object
    xds_port: int
    envoys: dict[str, EnvoyNode]
    backends: list[str]
    memo: BuildMemo = field(default_factory=BuildMemo)

    def push(self, snaps: dict[str | None, Snapshot]) -> None:
        for group, snap in snaps.items():
            self.loop.run(self.cache.set(snap, group))

    def push_config(self, cfg: Config, weights: dict[str, tuple[int, str]] | None = None) -> None:
        self.push(snapshots(cfg, weights, self.memo))

    def applied(self, protocol: str) -> bool:
        """True when that Envoy ACKed its group's newest snapshot (the last one set: published once its
        debounce is over) for every type, nothing pending."""
        snap = self.cache.latest(protocol) or self.cache.latest(None)
        node = self.node(protocol)
        return snap is not None and len(node["types"]) == 4 and all(
            t["acked_version"] == snap.versions[f"type.googleapis.com/envoy.config.{TYPES[name]}"]
            and not t["pending_nonces"] for name, t in node["types"].items())

    def settle(self, protocol: str) -> None:
        """Wait until that Envoy applied the published snapshot (the cache publishes after its debounce)."""
        wait_until(lambda: self.applied(protocol), 5, 0.02, f"{protocol} Envoy to ACK the snapshot")

    def node(self, protocol: str) -> dict:
        return next(n for n in self.servicer.describe_nodes() if n["node_id"] == self.envoys[protocol].node_id)


def config(h_or_backends, *, v1: int = 3, with_v2: bool = True, connect_timeout_s: float = 1.0,
           extra_services: list[dict] | None = None, groups: dict | None = None,
           panic_threshold_percent: float | None = None) -> Config:
    """chat-v1 on the first ``v1`` backends (round-robin fallback), chat-v2 on the last backend."""
    backends = h_or_backends.backends if isinstance(h_or_backends, Harness) else h_or_backends
    listeners = LISTENERS
    versions = [{"name": "v1", "endpoints": [{"address": a} for a in backends[:v1]]}]
    if with_v2:
        versions.append({"name": "v2", "endpoints": [{"address": backends[3]}]})
    panic = {} if panic_threshold_percent is None else {"panic_threshold_percent": panic_threshold_percent}
    return parse_config(yaml.safe_dump({
        "envoy": {"listener": f"127.0.0.1:{listeners['default']}"},
        "services": [{"name": "chat", "lb_policy": "round_robin", "connect_timeout_s": connect_timeout_s,
                      **panic, "versions": versions},
                     *(extra_services or [])],
        "node_groups": groups or {p: {"listener": f"127.0.0.1:{listeners[p]}"} for p in PROTOCOLS},
    }))


LISTENERS: dict[str, int] = {}
TYPES = {"Cluster": "cluster.v3.Cluster", "ClusterLoadAssignment": "endpoint.v3.ClusterLoadAssignment",
         "Listener": "listener.v3.Listener", "RouteConfiguration": "route.v3.RouteConfiguration"}


def endpoint_weights(cfg: Config, weights: dict[str, tuple[int, str]] | None = None) -> list[EndpointWeight]:
    """Weight 1 and HEALTHY for every endpoint unless ``weights[address]`` says otherwise."""
    weights = weights or {}
    return [EndpointWeight(s.cluster, s.address, *weights.get(s.address, (1, HEALTHY)), None, EndpointStats(), {}, ())
            for s in endpoint_specs(cfg)]


def snapshots(cfg: Config, weights: dict[str, tuple[int, str]] | None = None,
              memo: BuildMemo | None = None) -> dict[str | None, Snapshot]:
    """The default snapshot and one per node group, as the control plane builds them."""
    ws = endpoint_weights(cfg, weights)
    out: dict[str | None, Snapshot] = {None: build_snapshot(cfg, ws, EXT_PROC, memo)}
    for group in cfg.node_groups:
        out[group] = build_snapshot(cfg.for_node_group(group), ws, EXT_PROC, memo)
    return out


def unpack(res):
    """A snapshot Resource back to its message."""
    msg = symbol_database.Default().GetSymbol(res.packed.TypeName())()
    res.packed.Unpack(msg)
    return msg


async def _blast(url: str, n: int, concurrency: int, stop: threading.Event | None) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    sent = 0
    body = {"max_tokens": 1, "prompt": "hi"}

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal sent
        while (stop is None and sent < n) or (stop is not None and not stop.is_set()):
            sent += 1
            try:
                async with http.post(url, json=body) as r:
                    await r.read()
                    counts[(r.status, r.headers.get("x-served-by"))] += 1
            except (aiohttp.ClientError, TimeoutError) as err:
                counts[(0, type(err).__name__)] += 1

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return counts


def blast(url: str, n: int, concurrency: int = 32) -> collections.Counter:
    """Send ``n`` requests (no session header); ``{(status, served_by): count}``."""
    return asyncio.run(_blast(url, n, concurrency, None))


class Background:
    """Requests to ``urls`` from a thread until :meth:`stop`; ``counts`` per URL."""

    def __init__(self, urls: list[str], concurrency: int = 8) -> None:
        self._stop = threading.Event()
        self.counts: dict[str, collections.Counter] = {}

        async def run_all() -> None:
            results = await asyncio.gather(*(_blast(u, 0, concurrency, self._stop) for u in urls))
            self.counts = dict(zip(urls, results, strict=True))

        self._thread = threading.Thread(target=lambda: asyncio.run(run_all()), daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, collections.Counter]:
        self._stop.set()
        self._thread.join(30)
        return self.counts


def share(counts: collections.Counter, backends: list[str]) -> list[float]:
    total = sum(counts[(200, b)] for b in backends)
    return [counts[(200, b)] / total for b in backends]


def non_2xx(counts: collections.Counter) -> dict:
    return {k: v for k, v in counts.items() if not 200 <= k[0] < 300}


# --- the harness ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Iterator[Harness]:
    for name in ("default", *PROTOCOLS):
        LISTENERS[name] = stack.free_port()
    work: Path = tmp_path_factory.mktemp("ads")
    procs = []
    loop = LoopThread()
    try:
        backends = []
        for v in ("v1", "v1", "v1", "v2"):
            port = stack.free_port()
            procs.append(stack.start_sim(port, work, gpu_class="a100", version=v,
                                         extra=["--time-scale", "0.01", "--log-level", "warning"]))
            backends.append(f"127.0.0.1:{port}")
        cache = SnapshotCache()
        server, servicer, xds_port = loop.run(start_ads_server(cache, "127.0.0.1:0"))
        h = Harness(loop, cache, servicer, server, xds_port, {}, backends)
        h.push_config(config(backends))
        for protocol in PROTOCOLS:
            admin_port = stack.free_port()
            node_id = f"ads-{protocol}"
            proc = stack.start_envoy(render_bootstrap(xds_address=f"127.0.0.1:{xds_port}", node_id=node_id,
                                                      node_cluster=protocol, admin_port=admin_port,
                                                      delta=protocol == "delta"),
                                     work, admin_port, name=f"envoy-{protocol}")
            procs.append(proc)
            admin = f"http://127.0.0.1:{admin_port}"
            stack.wait_http(f"{admin}/ready", proc, timeout=20)
            h.envoys[protocol] = EnvoyNode(protocol, node_id, proc, admin, LISTENERS[protocol])
        yield h
        loop.run(h.server.stop(0))
    finally:
        for p in reversed(procs):
            p.stop()
        loop.close()


@pytest.fixture(params=PROTOCOLS)
def envoy(request, harness: Harness) -> EnvoyNode:
    """One of the two Envoys, after the baseline config is back and applied."""
    harness.push_config(config(harness))
    harness.settle(request.param)
    node = harness.envoys[request.param]
    wait_until(lambda: node.stat("cluster_manager.warming_clusters") == 0, 5, 0.05, "no cluster warming")
    return node


# --- protocol ------------------------------------------------------------------------------------


def test_each_stream_reports_its_protocol_versions_and_no_pending_nonce(harness: Harness, envoy: EnvoyNode):
    node = wait_until(lambda: (n := harness.node(envoy.protocol)) and all(
        not t["pending_nonces"] for t in n["types"].values()) and n, 3, 0.05, "every response ACKed")
    assert node["protocol"] == envoy.protocol
    assert set(node["types"]) == {"Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration"}
    for t in node["types"].values():
        assert t["acked_version"] == t["sent_version"] and t["nacks"] == 0
    assert node["types"]["Cluster"]["wildcard"] and node["types"]["Listener"]["wildcard"]
    assert node["connected_since"] < time.time()


def test_cds_change_with_same_endpoints_does_not_stall_warming(harness: Harness, envoy: EnvoyNode):
    """C01: a changed cluster definition is active again within 1 s (no 15 s warming wait)."""
    modified = envoy.stat("cluster_manager.cluster_modified") or 0
    harness.push_config(config(harness, connect_timeout_s=2.5))
    wait_until(lambda: (envoy.stat("cluster_manager.cluster_modified") or 0) > modified, 2, 0.02,
               "Envoy to apply the changed cluster")
    t0 = time.monotonic()
    wait_until(lambda: envoy.stat("cluster_manager.warming_clusters") == 0, 1.0, 0.02, "warming_clusters back to 0")
    assert time.monotonic() - t0 < 1.0
    counts = blast(envoy.url, 50, 4)
    assert not non_2xx(counts), counts


def test_tiny_scores_never_send_weight_zero(harness: Harness, envoy: EnvoyNode):
    """C02: 150 endpoints with zero scores: every weight >= 1 and Envoy ACKs (no NACK)."""
    many = [f"127.0.0.2:{20000 + i}" for i in range(150)]
    cfg = parse_config(yaml.safe_dump({
        "node_groups": {p: {"listener": f"127.0.0.1:{LISTENERS[p]}"} for p in PROTOCOLS},
        "services": [{"name": "chat", "versions": [
            {"name": "v1", "endpoints": [{"address": a} for a in harness.backends[:3]]},
            {"name": "v2", "endpoints": [{"address": a, "max_concurrency": 1} for a in many]},
        ]}]}))
    specs = endpoint_specs(cfg)
    worst = EndpointStats(latency_mean_ms=1e9, running=0.99, gpu_util=1.0, queue=1e6, sample_age_s=0.1)
    stats = {s.instance: worst for s in specs}
    stats[harness.backends[0]] = EndpointStats(latency_mean_ms=1, running=0, gpu_util=0, sample_age_s=0.1)
    weights, _ = compute_weights(specs, stats, EngineState(), replace(EngineParams(), max_weight=1), plugins=BUILTIN)
    nacks = harness.node(envoy.protocol)["types"]["ClusterLoadAssignment"]["nacks"]
    harness.push({g: build_snapshot(cfg.for_node_group(g) if g else cfg, weights, EXT_PROC)
                  for g in (None, *PROTOCOLS)})
    hosts = wait_until(lambda: (h := envoy.hosts("chat-v2")) and len(h) == 150 and h, 3, 0.05, "150 hosts")
    assert all(h["weight"] >= 1 for h in hosts.values())
    assert harness.node(envoy.protocol)["types"]["ClusterLoadAssignment"]["nacks"] == nacks


def test_nacked_config_keeps_last_good_and_is_not_resent(harness: Harness, envoy: EnvoyNode):
    """C03: Envoy rejects a cluster; the last good config serves, the NACK is visible, no resend loop."""
    good = snapshots(config(harness))
    bad = {}
    for group, snap in good.items():
        messages = {t: {n: unpack(r) for n, r in snap.of(t).items()} for t in snap.resources}
        c = cluster_pb2.Cluster()
        c.CopyFrom(messages[CLUSTER_TYPE]["chat-v1"])
        c.connect_timeout.CopyFrom(duration_pb2.Duration(seconds=-5))  # Envoy: must be > 0; we don't check it
        messages[CLUSTER_TYPE]["chat-v1"] = c
        bad[group] = make_snapshot(messages)
    before = harness.node(envoy.protocol)["types"]["Cluster"]
    harness.push(bad)
    after = wait_until(lambda: (t := harness.node(envoy.protocol)["types"]["Cluster"])["nacks"] > before["nacks"]
                       and t, 3, 0.05, "a NACK")
    assert "Expected positive duration" in (after["last_nack"] or ""), after["last_nack"]
    assert after["acked_version"] == before["acked_version"]
    counts = blast(envoy.url, 30, 3)
    assert not non_2xx(counts), counts
    time.sleep(1.5)
    assert harness.node(envoy.protocol)["types"]["Cluster"]["nacks"] == after["nacks"], "the rejected version re-sent"
    harness.push_config(config(harness, connect_timeout_s=1.5))
    wait_until(lambda: (t := harness.node(envoy.protocol)["types"]["Cluster"])["acked_version"] == t["sent_version"]
               and not t["pending_nonces"], 3, 0.05, "the next good change to be ACKed")


def test_removed_then_readded_cluster_gets_its_endpoints(harness: Harness, envoy: EnvoyNode):
    """C15: a service version removed and added back is served again (EDS sent for it)."""
    harness.push_config(config(harness, with_v2=False))
    wait_until(lambda: "chat-v2" not in envoy_hosts(envoy.admin), 3, 0.05, "chat-v2 removed")
    harness.push_config(config(harness))
    hosts = wait_until(lambda: envoy.hosts("chat-v2"), 3, 0.05, "chat-v2 back with hosts")
    assert list(hosts) == [harness.backends[3]]
    wait_until(lambda: envoy.stat("cluster.chat-v2.membership_healthy") == 1, 3, 0.05, "chat-v2 healthy")


def test_empty_cluster_gets_an_empty_assignment_at_once_and_endpoints_later(harness: Harness, envoy: EnvoyNode):
    """A new cluster with no endpoints is active at once (empty ClusterLoadAssignment, no warming);
    its endpoints arrive with a later EDS update."""
    embed = {"name": "embed", "hosts": ["embed.local"], "versions": [
        {"name": "e1", "endpoints": [{"address": harness.backends[3]}]}]}
    cfg = config(harness, with_v2=False, extra_services=[embed])
    ws = [w for w in endpoint_weights(cfg) if w.cluster != "embed-e1"]  # the engine has no weights for it yet
    harness.push({g: build_snapshot(cfg.for_node_group(g) if g else cfg, ws, EXT_PROC) for g in (None, *PROTOCOLS)})
    wait_until(lambda: "embed-e1" in envoy_hosts(envoy.admin), 2, 0.02, "embed-e1 in Envoy")
    assert envoy.hosts("embed-e1") == {}
    assert envoy.stat("cluster_manager.warming_clusters") == 0
    harness.push_config(cfg)
    hosts = wait_until(lambda: envoy.hosts("embed-e1"), 2, 0.02, "embed-e1's endpoint")
    assert list(hosts) == [harness.backends[3]]


# --- weights and health ---------------------------------------------------------------------------


def test_weights_split_traffic_and_a_weights_only_change_takes_effect(harness: Harness, envoy: EnvoyNode):
    """1:2:7 on round robin gives 10/20/70 % within +-3 % over 10 000 requests; then 7:2:1 (an EDS-only
    change, no CDS push) turns the split around."""
    v1 = harness.backends[:3]
    cds_acks = harness.node(envoy.protocol)["types"]["Cluster"]["acks"]
    harness.push_config(config(harness), {v1[0]: (1, HEALTHY), v1[1]: (2, HEALTHY), v1[2]: (7, HEALTHY)})
    wait_until(lambda: [envoy.hosts()[a]["weight"] for a in v1] == [1, 2, 7], 3, 0.02, "weights 1:2:7 in Envoy")
    counts = blast(envoy.url, 10_000, 32)
    assert not non_2xx(counts), non_2xx(counts)
    for got, want in zip(share(counts, v1), (0.1, 0.2, 0.7), strict=True):
        assert abs(got - want) <= 0.03, share(counts, v1)
    harness.push_config(config(harness), {v1[0]: (7, HEALTHY), v1[1]: (2, HEALTHY), v1[2]: (1, HEALTHY)})
    wait_until(lambda: [envoy.hosts()[a]["weight"] for a in v1] == [7, 2, 1], 3, 0.02, "weights 7:2:1 in Envoy")
    counts = blast(envoy.url, 2_000, 32)
    for got, want in zip(share(counts, v1), (0.7, 0.2, 0.1), strict=True):
        assert abs(got - want) <= 0.03, share(counts, v1)
    assert harness.node(envoy.protocol)["types"]["Cluster"]["acks"] == cds_acks, "a weights-only change sent CDS"


def test_draining_hosts_get_no_traffic(harness: Harness, envoy: EnvoyNode):
    v1 = harness.backends[:3]
    harness.push_config(config(harness), {v1[0]: (50, DRAINING)})
    wait_until(lambda: envoy.hosts()[v1[0]]["health"] == "DRAINING", 3, 0.02, "DRAINING in Envoy")
    counts = blast(envoy.url, 600, 16)
    assert not non_2xx(counts), counts
    assert counts[(200, v1[0])] == 0 and counts[(200, v1[1])] > 0 and counts[(200, v1[2])] > 0, counts


def test_every_host_unhealthy_gives_503_with_panic_threshold_0_and_panic_routing_above(
        harness: Harness, envoy: EnvoyNode):
    """With healthy_panic_threshold 0 Envoy's panic mode is off, so with every host UNHEALTHY Envoy
    1.40 (override_host -> round robin fallback) answers 503 "no healthy upstream" and never panics.
    With a threshold above 0 the same state panics: traffic goes to all hosts."""
    v1 = harness.backends[:3]
    all_bad = {a: (1, UNHEALTHY) for a in v1}
    harness.push_config(config(harness, panic_threshold_percent=0), all_bad)
    wait_until(lambda: all(h["health"] == "UNHEALTHY" for h in envoy.hosts().values()), 3, 0.02, "all UNHEALTHY")
    none_healthy = envoy.stat("cluster.chat-v1.upstream_cx_none_healthy") or 0
    counts = blast(envoy.url, 60, 4)
    assert counts == {(503, None): 60}, counts
    assert (envoy.stat("cluster.chat-v1.upstream_cx_none_healthy") or 0) - none_healthy == 60
    assert not envoy.stat("cluster.chat-v1.lb_healthy_panic")
    assert requests.post(envoy.url, json={}, timeout=5).json()["error"] == {   # Envoy's reply, OpenAI's shape
        "message": "no healthy upstream", "type": "server_error", "param": None, "code": "no_healthy_upstream"}
    harness.push_config(config(harness, panic_threshold_percent=50), all_bad)
    wait_until(lambda: envoy.stat("cluster_manager.warming_clusters") == 0 and not non_2xx(blast(envoy.url, 3, 1)),
               3, 0.05, "panic routing with threshold 50")
    counts = blast(envoy.url, 300, 4)
    assert not non_2xx(counts) and all(counts[(200, a)] > 0 for a in v1), counts
    assert (envoy.stat("cluster.chat-v1.lb_healthy_panic") or 0) >= 300


def test_engine_exclusion_plus_envoy_ejection_never_leave_a_cluster_with_no_host(harness: Harness):
    """Issue 15 item 4: two endpoints; the engine marks one UNHEALTHY, the other fails every request.
    A backend's own 500 (a GPU out of memory) no longer makes Envoy eject it (one tier:
    ``enforcing_consecutive_5xx`` 0); gateway failures (here 503s) do. With panic threshold 0 every
    request without a session then got 503 "no healthy upstream". With the default threshold (1 %)
    Envoy panics when no host is left and spreads requests over both: the excluded-but-working one
    answers."""
    from aiohttp import web

    status = {"code": 500}

    async def failing(_: web.Request) -> web.Response:
        return web.Response(status=status["code"], text="CUDA out of memory", headers={"x-served-by": "failing"})

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", failing)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, port = harness.loop.run(start())
    bad, excluded = f"127.0.0.1:{port}", harness.backends[0]
    node = harness.envoys["sotw"]
    try:
        harness.push_config(config([excluded, bad], v1=2, with_v2=False), {excluded: (1, UNHEALTHY)})
        harness.settle("sotw")
        wait_until(lambda: node.hosts().get(excluded, {}).get("health") == "UNHEALTHY" and bad in node.hosts(),
                   5, 0.05, "the engine's exclusion in Envoy")
        blast(node.url, 20, 1)  # 500s: consecutive_5xx flags the failing host, but does not eject it
        assert (node.stat("cluster.chat-v1.outlier_detection.ejections_detected_consecutive_5xx") or 0) >= 1
        assert (node.stat("cluster.chat-v1.outlier_detection.ejections_active") or 0) == 0
        status["code"] = 503
        blast(node.url, 20, 1)  # gateway failures: consecutive_gateway_failure ejects it
        wait_until(lambda: (node.stat("cluster.chat-v1.outlier_detection.ejections_active") or 0) >= 1, 5, 0.05,
                   "Envoy to eject the failing host")
        counts = blast(node.url, 40, 4)
        assert counts[(503, None)] == 0, counts
        assert counts[(200, excluded)] > 0, counts
        assert (node.stat("cluster.chat-v1.lb_healthy_panic") or 0) > 0
    finally:
        harness.loop.run(runner.cleanup())
        harness.push_config(config(harness))
        harness.settle("sotw")


# --- fleet ----------------------------------------------------------------------------------------


def test_two_envoys_with_different_node_ids_get_their_own_config(harness: Harness):
    """Node-specific config by node.cluster: the sotw group serves chat and embed on its listener, the
    delta group only chat on its own; the control plane keys each stream by node id."""
    embed = {"name": "embed", "hosts": ["embed.local"], "versions": [
        {"name": "e1", "endpoints": [{"address": harness.backends[3]}]}]}
    groups = {"sotw": {"listener": f"127.0.0.1:{LISTENERS['sotw']}"},
              "delta": {"listener": f"127.0.0.1:{LISTENERS['delta']}", "services": ["chat"]}}
    harness.push_config(config(harness, with_v2=False, extra_services=[embed], groups=groups))
    sotw, delta = harness.envoys["sotw"], harness.envoys["delta"]
    wait_until(lambda: "embed-e1" in envoy_hosts(sotw.admin), 3, 0.05, "embed-e1 on the sotw Envoy")
    time.sleep(0.3)
    assert "embed-e1" not in envoy_hosts(delta.admin)
    for e in (sotw, delta):
        assert not non_2xx(blast(e.url, 20, 2))
    nodes = {n["node_id"]: n for n in harness.servicer.describe_nodes()}
    assert (nodes["ads-sotw"]["protocol"], nodes["ads-sotw"]["node_cluster"]) == ("sotw", "sotw")
    assert (nodes["ads-delta"]["protocol"], nodes["ads-delta"]["node_cluster"]) == ("delta", "delta")
    assert nodes["ads-sotw"]["types"]["Cluster"]["acked_version"] != nodes["ads-delta"]["types"]["Cluster"][
        "acked_version"]


def test_control_plane_restart_under_load_same_then_changed_state(harness: Harness):
    """Both Envoys under load while the ADS server restarts twice: with the same snapshots, then with
    changed weights. Zero 5xx; both reconnect; the changed weights arrive."""
    v1 = harness.backends[:3]
    harness.push_config(config(harness))
    load = Background([e.url for e in harness.envoys.values()], concurrency=4)
    try:
        for weights in (None, {v1[0]: (5, HEALTHY)}):
            cache = SnapshotCache()
            for group, snap in snapshots(config(harness), weights).items():
                harness.loop.run(cache.set(snap, group))
            harness.loop.run(harness.server.stop(0))
            time.sleep(0.5)
            harness.server, harness.servicer, _ = harness.loop.run(
                start_ads_server(cache, f"127.0.0.1:{harness.xds_port}"))
            harness.cache = cache
            wait_until(lambda: {n["node_id"] for n in harness.servicer.describe_nodes()} == {"ads-sotw", "ads-delta"},
                       10, 0.1, "both Envoys reconnected")
            want = (weights or {}).get(v1[0], (1,))[0]
            for e in harness.envoys.values():
                wait_until(lambda e=e, want=want: e.hosts()[v1[0]]["weight"] == want, 5, 0.05,
                           f"weight {want} in {e.protocol}")
    finally:
        counts = load.stop()
    for url, c in counts.items():
        assert sum(c.values()) > 100, (url, c)
        assert not non_2xx(c), (url, non_2xx(c))


def test_fifty_updates_per_second_for_ten_seconds_converge(harness: Harness):
    """500 snapshots at 50/s (weights every time, a cluster definition every 10th): afterwards both
    Envoys have the last weights, nothing is warming, every response is ACKed."""
    v1 = harness.backends[:3]
    nacks = {p: sum(t["nacks"] for t in harness.node(p)["types"].values()) for p in PROTOCOLS}
    load = Background([e.url for e in harness.envoys.values()], concurrency=2)
    try:
        start = time.monotonic()
        for i in range(500):
            w = {a: (1 + (i * 7 + k * 3) % 50, HEALTHY) for k, a in enumerate(v1)}
            harness.push_config(config(harness, connect_timeout_s=1.0 + (i // 10) % 5 / 10), w)
            time.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))
        last = [w[a][0] for a in v1]
    finally:
        counts = load.stop()
    for e in harness.envoys.values():
        wait_until(lambda e=e: [e.hosts()[a]["weight"] for a in v1] == last, 3, 0.05, f"last weights in {e.protocol}")
        wait_until(lambda e=e: e.stat("cluster_manager.warming_clusters") == 0, 2, 0.05, "no cluster warming")
        node = wait_until(lambda e=e: (n := harness.node(e.protocol)) and all(
            not t["pending_nonces"] and t["acked_version"] == t["sent_version"] for t in n["types"].values()) and n,
            3, 0.05, f"{e.protocol}: every response ACKed")
        assert sum(t["nacks"] for t in node["types"].values()) == nacks[e.protocol]
    for url, c in counts.items():
        assert not non_2xx(c), (url, non_2xx(c))
