"""A second real xDS client: grpcio's proxyless xDS (``xds:///`` target, ``GRPC_XDS_BOOTSTRAP``).

What grpcio 1.85 does with our resources, asserted exactly (the reasons are in README, "gRPC
proxyless clients"):
- the Envoy resources are refused: the listener is a TCP listener with the ext_proc filter
  (NACK "unsupported filter type"; without that filter: "not an API listener"), and the clusters'
  only LB policy is ``override_host`` (NACK "no supported load balancing policy config found");
- what works: an API listener named like the target, RDS, CDS with ``ring_hash`` and EDS whose
  locality has a name and a weight, served by the same ADS server: the 1:2:7 endpoint weights are
  honoured; with ``round_robin`` gRPC accepts them but ignores endpoint weights (1:1:1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.load_balancing_policies.ring_hash.v3 import ring_hash_pb2  # noqa: F401 (registers the type)
from google.protobuf import json_format, symbol_database

from tests.integration.conftest import LoopThread
from tests.support.snapshots import make_snapshot
from xds_server.ads.cache import SnapshotCache
from xds_server.ads.server import start_ads_server
from xds_server.config import parse_config
from xds_server.control import endpoint_specs
from xds_server.engine.types import HEALTHY, EndpointWeight
from xds_server.metrics.stats import EndpointStats
from xds_server.resources.build import build_snapshot
from xds_server.resources.endpoints import build_assignment
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, Snapshot

pytestmark = pytest.mark.integration

T = "type.googleapis.com/"
CLIENT = """
import collections, json, sys, grpc
call = grpc.insecure_channel(sys.argv[1]).unary_unary("/inferlb.test.Echo/Call")
counts = collections.Counter()
for _ in range(int(sys.argv[2])):
    try:
        counts[call(b"", timeout=5).decode()] += 1
    except grpc.RpcError as err:
        counts[err.code().name + ": " + err.details()] += 1
        if sum(counts.values()) >= 3 and not any(k.isdigit() for k in counts):
            break
print(json.dumps(counts))
"""


async def start_upstreams() -> tuple[list[grpc.aio.Server], list[int]]:
    """Three gRPC servers answering ``/inferlb.test.Echo/Call`` with their index (run on the test loop)."""
    servers, ports = [], []
    for i in range(3):
        server = grpc.aio.server()

        def handler(i=i):
            async def call(_req, _ctx):
                return str(i).encode()
            return grpc.unary_unary_rpc_method_handler(call)

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inferlb.test.Echo",
                                                                              {"Call": handler()}),))
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        servers.append(server)
    return servers, ports


@dataclass
class Env:
    loop: LoopThread
    ports: list[int]
    cache: SnapshotCache
    servicer: object
    xds_port: int
    work: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    loop = LoopThread()
    upstreams, ports = loop.run(start_upstreams())
    cache = SnapshotCache(debounce_s=0, debounce_max_s=0)
    server, servicer, port = loop.run(start_ads_server(cache, "127.0.0.1:0"))
    yield Env(loop, ports, cache, servicer, port, tmp_path_factory.mktemp("grpc"))
    for s in (server, *upstreams):
        loop.run(s.stop(0))
    loop.close()


def weights_127(ports: list[int]):
    cfg = parse_config(yaml.safe_dump({"services": [{"name": "chat", "lb_policy": "round_robin", "versions": [
        {"name": "v1", "endpoints": [{"address": f"127.0.0.1:{p}"} for p in ports]}]}]}))
    return cfg, [EndpointWeight(s.cluster, s.address, w, HEALTHY, None, EndpointStats(), {}, ())
                 for s, w in zip(endpoint_specs(cfg), (1, 2, 7), strict=True)]


def grpc_view(ports: list[int], policy: str) -> Snapshot:
    """Resources grpcio takes: API listener ``chat`` -> RDS ``chat`` -> CDS ``chat-v1`` (``policy``) -> EDS
    with a named, weighted locality; the endpoints and weights are ours (build_assignment)."""
    cfg, weights = weights_127(ports)
    cla = build_assignment("chat-v1", weights)
    cla.endpoints[0].locality.zone = "default"
    cla.endpoints[0].load_balancing_weight.value = 1
    policy_type = {"ring_hash": "ring_hash.v3.RingHash", "round_robin": "round_robin.v3.RoundRobin"}[policy]
    cluster = json_format.ParseDict({
        "name": "chat-v1", "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {"name": policy, "typed_config": {
            "@type": f"{T}envoy.extensions.load_balancing_policies.{policy_type}"}}}]},
    }, cluster_pb2.Cluster())
    listener = json_format.ParseDict({"name": "chat", "api_listener": {"api_listener": {
        "@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "rds": {"route_config_name": "chat", "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": [{"name": "router",
                          "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}}],
    }}}, listener_pb2.Listener())
    routes = json_format.ParseDict({"name": "chat", "virtual_hosts": [
        {"name": "chat", "domains": ["chat"], "routes": [{"match": {"prefix": ""}, "route": {"cluster": "chat-v1"}}]}]},
        route_pb2.RouteConfiguration())
    return make_snapshot({CLUSTER_TYPE: {"chat-v1": cluster}, ENDPOINT_TYPE: {"chat-v1": cla},
                          LISTENER_TYPE: {"chat": listener}, ROUTE_TYPE: {"chat": routes}})


def run_client(env: Env, snap: Snapshot, target: str, calls: int, node_id: str) -> dict[str, int]:
    """Publish ``snap``, run a grpcio xDS client process on ``target``; its reply counts."""
    env.loop.run(env.cache.set(snap))
    port = env.xds_port
    boot = env.work / f"{node_id}.json"
    boot.write_text(json.dumps({
        "xds_servers": [{"server_uri": f"127.0.0.1:{port}", "channel_creds": [{"type": "insecure"}],
                         "server_features": ["xds_v3"]}],
        "node": {"id": node_id, "cluster": "grpc-proxyless"}}))
    out = subprocess.run([sys.executable, "-c", CLIENT, target, str(calls)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "GRPC_XDS_BOOTSTRAP": str(boot), "GRPC_VERBOSITY": "NONE"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grpc_refuses_the_envoy_listener_because_of_ext_proc_and_no_api_listener(env: Env):
    cfg, weights = weights_127(env.ports)
    counts = run_client(env, build_snapshot(cfg, weights, "127.0.0.1:1"), "xds:///inferlb", 3, "grpc-envoy-view")
    [(error, _n)] = counts.items()
    assert error.startswith("UNAVAILABLE") and "LDS resource inferlb" in error, counts
    assert "ExternalProcessor] error:unsupported filter type" in error, counts


def test_grpc_refuses_override_host_as_the_only_lb_policy(env: Env):
    cfg, weights = weights_127(env.ports)
    view = grpc_view(env.ports, "ring_hash")
    ours = build_snapshot(cfg, weights, "127.0.0.1:1").of(CLUSTER_TYPE)["chat-v1"]  # override_host -> round robin
    cluster = cluster_pb2.Cluster()
    ours.packed.Unpack(cluster)
    msgs = {t: {} for t in view.resources}
    for t in view.resources:
        for n, r in view.of(t).items():
            m = symbol_database.Default().GetSymbol(r.packed.TypeName())()
            r.packed.Unpack(m)
            msgs[t][n] = m
    msgs[CLUSTER_TYPE]["chat-v1"] = cluster
    counts = run_client(env, make_snapshot(msgs), "xds:///chat", 3, "grpc-override-host")
    [(error, _n)] = counts.items()
    assert "CDS resource chat-v1" in error and "no supported load balancing policy config found" in error, counts


def test_grpc_honours_our_endpoint_weights_with_ring_hash(env: Env):
    counts = run_client(env, grpc_view(env.ports, "ring_hash"), "xds:///chat", 3000, "grpc-ring-hash")
    total = sum(counts.get(str(i), 0) for i in range(3))
    assert total == 3000, counts
    # ring_hash gives each host ring arcs in proportion to its weight, but the arcs' positions are hashes:
    # the realised shares vary by a few % around the weights (seen: 9.5/16.8/73.7 %), hence +-5 %.
    for i, want in enumerate((0.1, 0.2, 0.7)):
        assert abs(counts[str(i)] / total - want) <= 0.05, counts


def test_grpc_round_robin_takes_the_resources_but_ignores_endpoint_weights(env: Env):
    counts = run_client(env, grpc_view(env.ports, "round_robin"), "xds:///chat", 600, "grpc-round-robin")
    assert sum(counts.get(str(i), 0) for i in range(3)) == 600, counts
    assert all(abs(counts[str(i)] / 600 - 1 / 3) <= 0.03 for i in range(3)), counts  # not 10/20/70 %
