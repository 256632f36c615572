"""Config + engine weights -> versioned CDS/EDS resources."""

from __future__ import annotations

import re

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2

from tests.support.factories import config, service, version, weight
from tests.support.snapshots import assignments_of
from xds_server.control import endpoint_specs, engine_params
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EngineState
from xds_server.resources.build import build_snapshot
from xds_server.resources.clusters import build_cluster
from xds_server.resources.endpoints import build_assignment
from xds_server.resources.names import EXT_PROC_CLUSTER, LISTENER_NAME, ROUTE_NAME
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, TYPE_ORDER

CFG = config(
    [
        service("llm", [version("v1", 3, subnet=1), version("v2", 2, subnet=2)], connect_timeout_s=2.5,
                panic_threshold_percent=10),
        service("embed", [version("e1", 2, subnet=3)], lb_policy="round_robin", hosts=["embed.example.com"]),
    ],
    headers={"override_host": "x-pin-host", "cluster": "x-route-cluster"},
)
CLUSTERS = ["llm-v1", "llm-v2", "embed-e1"]
EXT = "127.0.0.1:18080"
ALL_TYPES = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)


def snapshot(cfg, weights, ext=EXT):
    return build_snapshot(cfg, weights, ext)


def weights_of(cfg, overrides: dict[str, tuple[int, str]] | None = None):
    """One verdict per configured endpoint: weight 10 + index, HEALTHY, unless overridden."""
    overrides = overrides or {}
    out = []
    for i, s in enumerate(endpoint_specs(cfg)):
        w, h = overrides.get(s.address, (10 + i, HEALTHY))
        out.append(weight(s.cluster, s.address, w, h))
    return out


def unpack(any_msg, cls):
    msg = cls()
    assert any_msg.Unpack(msg), any_msg.type_url
    return msg


def cluster_of(snap, name) -> cluster_pb2.Cluster:
    return unpack(snap.of(CLUSTER_TYPE)[name].packed, cluster_pb2.Cluster)


# --- clusters -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("svc_index", "fallback_name", "fallback_cls"), [
    (0, "envoy.load_balancing_policies.least_request", least_request_pb2.LeastRequest),
    (1, "envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin),
])
def test_cluster_uses_override_host_with_the_configured_header_and_a_weighted_fallback(
    svc_index, fallback_name, fallback_cls
):
    svc = CFG.services[svc_index]
    c = build_cluster("some-cluster", svc, CFG.headers.override_host)
    assert c.name == "some-cluster"
    assert len(c.load_balancing_policy.policies) == 1
    ext = c.load_balancing_policy.policies[0].typed_extension_config
    assert ext.name == "envoy.load_balancing_policies.override_host"
    override = unpack(ext.typed_config, override_host_pb2.OverrideHost)
    assert [s.header for s in override.override_host_sources] == ["x-pin-host"]
    fallback = override.fallback_policy.policies
    assert len(fallback) == 1
    assert fallback[0].typed_extension_config.name == fallback_name
    unpack(fallback[0].typed_extension_config.typed_config, fallback_cls)


def test_cluster_is_eds_over_ads():
    c = build_cluster("llm-v1", CFG.services[0], CFG.headers.override_host)
    assert c.type == cluster_pb2.Cluster.EDS
    source = c.eds_cluster_config.eds_config
    assert source.WhichOneof("config_source_specifier") == "ads"
    assert source.resource_api_version == config_source_pb2.V3


def test_cluster_timeout_and_panic_threshold_from_config():
    c = build_cluster("llm-v1", CFG.services[0], CFG.headers.override_host)
    assert c.connect_timeout.ToNanoseconds() == 2_500_000_000
    assert c.common_lb_config.healthy_panic_threshold.value == 10
    c = build_cluster("embed-e1", CFG.services[1], CFG.headers.override_host)
    assert c.connect_timeout.ToNanoseconds() == 1_000_000_000
    assert c.common_lb_config.healthy_panic_threshold.value == 1  # the default: panic only when no host is left


# --- assignments ----------------------------------------------------------------------------------


def test_assignment_carries_weights_and_health():
    cla = build_assignment("llm-v1", [
        weight("llm-v1", "10.0.0.1:8000", 7, HEALTHY),
        weight("llm-v1", "10.0.0.2:9000", 1, UNHEALTHY),
        weight("llm-v1", "[fd00::3]:8001", 42, DRAINING),
    ])
    assert cla.cluster_name == "llm-v1"
    assert len(cla.endpoints) == 1
    got = [
        (e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value,
         e.load_balancing_weight.value, e.health_status)
        for e in cla.endpoints[0].lb_endpoints
    ]
    assert got == [
        ("10.0.0.1", 8000, 7, health_check_pb2.HEALTHY),
        ("10.0.0.2", 9000, 1, health_check_pb2.UNHEALTHY),
        ("fd00::3", 8001, 42, health_check_pb2.DRAINING),
    ]


@pytest.mark.parametrize("bad", [0, -1])
def test_weight_below_1_is_refused(bad):
    with pytest.raises(ValueError, match="10.0.0.2:8000"):
        build_assignment("c", [weight("c", "10.0.0.1:8000", 5), weight("c", "10.0.0.2:8000", bad)])


def test_snapshot_builds_one_cluster_and_one_assignment_per_version():
    snap = snapshot(CFG, weights_of(CFG))
    assert set(snap.of(CLUSTER_TYPE)) == {EXT_PROC_CLUSTER, *CLUSTERS}
    assert list(snap.of(ENDPOINT_TYPE)) == CLUSTERS
    for name in CLUSTERS:
        assert cluster_of(snap, name).name == name
    assignments = assignments_of(snap)
    assert set(assignments) == set(CLUSTERS)
    assert [e.load_balancing_weight.value for e in assignments["llm-v1"].endpoints[0].lb_endpoints] == [10, 11, 12]
    assert [e.load_balancing_weight.value for e in assignments["embed-e1"].endpoints[0].lb_endpoints] == [15, 16]
    assert list(snap.of(LISTENER_TYPE)) == [LISTENER_NAME]
    assert list(snap.of(ROUTE_TYPE)) == [ROUTE_NAME]
    assert set(snap.versions) == set(ALL_TYPES)
    assert snap.of("type.googleapis.com/envoy.config.route.v3.ScopedRouteConfiguration") == {}


def test_push_order_is_clusters_endpoints_listeners_routes():
    assert TYPE_ORDER == (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)


def test_ext_proc_cluster_points_at_the_picker():
    snap = snapshot(CFG, weights_of(CFG), "127.0.0.1:18555")
    c = cluster_of(snap, EXT_PROC_CLUSTER)
    assert c.type == cluster_pb2.Cluster.STATIC
    sa = c.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (sa.address, sa.port_value) == ("127.0.0.1", 18555)


def test_cluster_without_weights_gets_an_empty_assignment():
    snap = snapshot(CFG, [w for w in weights_of(CFG) if w.cluster != "llm-v2"])
    assert len(assignments_of(snap)["llm-v2"].endpoints) == 0


def test_snapshot_from_the_engine_is_valid_for_envoy():
    # A first round with no metrics: neutral weights, every one >= 1.
    weights, _ = compute_weights(endpoint_specs(CFG), {}, EngineState(), engine_params(CFG), plugins=BUILTIN)
    snap = snapshot(CFG, weights)
    for cla in assignments_of(snap).values():
        for e in cla.endpoints[0].lb_endpoints:
            assert e.load_balancing_weight.value >= 1


# --- versions -------------------------------------------------------------------------------------


def versions(snap):
    return {t: {n: r.version for n, r in snap.of(t).items()} for t in ALL_TYPES}


def test_build_twice_gives_the_same_versions():
    a = snapshot(CFG, weights_of(CFG))
    b = snapshot(CFG, weights_of(CFG))
    assert versions(a) == versions(b)
    assert dict(a.versions) == dict(b.versions)
    assert a.version == b.version
    for v in (a.version, *a.versions.values(), *versions(a)[CLUSTER_TYPE].values()):
        assert re.fullmatch(r"[0-9a-f]{16}", v)


def test_one_weight_change_changes_only_that_clusters_eds_version():
    base = snapshot(CFG, weights_of(CFG))
    target = endpoint_specs(CFG)[3]  # first endpoint of llm-v2
    changed = snapshot(CFG, weights_of(CFG, {target.address: (99, HEALTHY)}))
    v0, v1 = versions(base), versions(changed)
    for t in (CLUSTER_TYPE, LISTENER_TYPE, ROUTE_TYPE):
        assert v1[t] == v0[t]
        assert changed.versions[t] == base.versions[t]
    assert [n for n in CLUSTERS if v1[ENDPOINT_TYPE][n] != v0[ENDPOINT_TYPE][n]] == ["llm-v2"]
    assert changed.versions[ENDPOINT_TYPE] != base.versions[ENDPOINT_TYPE]
    assert changed.version != base.version


def test_health_change_alone_changes_the_eds_version():
    base = snapshot(CFG, weights_of(CFG))
    target = endpoint_specs(CFG)[0]
    changed = snapshot(CFG, weights_of(CFG, {target.address: (10, DRAINING)}))
    v0, v1 = versions(base), versions(changed)
    assert [n for n in CLUSTERS if v1[ENDPOINT_TYPE][n] != v0[ENDPOINT_TYPE][n]] == ["llm-v1"]


def test_cluster_change_changes_only_that_services_cds_versions():
    other = config(
        [
            service("llm", [version("v1", 3, subnet=1), version("v2", 2, subnet=2)], connect_timeout_s=5,
                    panic_threshold_percent=10),
            service("embed", [version("e1", 2, subnet=3)], lb_policy="round_robin", hosts=["embed.example.com"]),
        ],
        headers={"override_host": "x-pin-host", "cluster": "x-route-cluster"},
    )
    a, b = snapshot(CFG, weights_of(CFG)), snapshot(other, weights_of(other))
    va, vb = versions(a), versions(b)
    assert va[ENDPOINT_TYPE] == vb[ENDPOINT_TYPE]
    assert a.versions[ENDPOINT_TYPE] == b.versions[ENDPOINT_TYPE]
    assert [n for n in CLUSTERS if va[CLUSTER_TYPE][n] != vb[CLUSTER_TYPE][n]] == ["llm-v1", "llm-v2"]
    assert a.versions[CLUSTER_TYPE] != b.versions[CLUSTER_TYPE]


def test_picker_address_change_changes_only_the_ext_proc_cluster():
    a = snapshot(CFG, weights_of(CFG), "127.0.0.1:18080")
    b = snapshot(CFG, weights_of(CFG), "127.0.0.1:18081")
    va, vb = versions(a), versions(b)
    assert [n for n in va[CLUSTER_TYPE] if va[CLUSTER_TYPE][n] != vb[CLUSTER_TYPE][n]] == [EXT_PROC_CLUSTER]
    for t in (ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE):
        assert va[t] == vb[t]


def test_override_header_change_changes_every_cluster():
    other = config([service("llm", [version("v1", 1, subnet=9)])], headers={"override_host": "x-other"})
    same = config([service("llm", [version("v1", 1, subnet=9)])])
    a, b = snapshot(same, weights_of(same)), snapshot(other, weights_of(other))
    assert a.of(CLUSTER_TYPE)["llm-v1"].version != b.of(CLUSTER_TYPE)["llm-v1"].version


def test_packed_assignment_is_the_built_assignment():
    snap = snapshot(CFG, weights_of(CFG))
    res = snap.of(ENDPOINT_TYPE)["llm-v1"]
    cla = unpack(res.packed, endpoint_pb2.ClusterLoadAssignment)
    limits = {e.address: e.max_concurrency for s in CFG.services for v in s.versions for e in v.endpoints}
    classes = {e.address: e.gpu_class for s in CFG.services for v in s.versions for e in v.endpoints}
    rebuilt = build_assignment("llm-v1", [w for w in weights_of(CFG) if w.cluster == "llm-v1"], limits, classes)
    assert cla == rebuilt
    meta = cla.endpoints[0].metadata.filter_metadata["inferlb"]  # locality-wide: every endpoint has these
    assert meta.fields["max_concurrency"].number_value == 8  # the endpoint default
    assert meta.fields["gpu_class"].string_value == "a100"  # for the picker's cost model per GPU class
    assert not any(lb.HasField("metadata") for lb in cla.endpoints[0].lb_endpoints)


def test_only_endpoints_that_differ_from_the_locality_carry_their_own_metadata():
    ws = [weight("c", f"10.0.0.{i}:8000", 5) for i in range(5)]
    limits = {w.address: 8 for w in ws} | {"10.0.0.1:8000": 4}
    del limits["10.0.0.2:8000"]
    classes = {w.address: "a100" for w in ws} | {"10.0.0.3:8000": "a10"}
    locality = build_assignment("c", ws, limits, classes).endpoints[0]
    assert dict(locality.metadata.filter_metadata["inferlb"]) == {"max_concurrency": 8, "gpu_class": "a100"}
    own = [dict(lb.metadata.filter_metadata["inferlb"]) if lb.HasField("metadata") else None
           for lb in locality.lb_endpoints]
    # 0 and "" stand for "none" (as if absent) where the locality has a value
    assert own == [None, {"max_concurrency": 4}, {"max_concurrency": 0}, {"gpu_class": "a10"}, None]


def _clusters(cfg) -> dict[str, cluster_pb2.Cluster]:
    out = {}
    for r in snapshot(cfg, []).resources[CLUSTER_TYPE].values():
        c = cluster_pb2.Cluster()
        r.packed.Unpack(c)
        out[c.name] = c
    return out


def _thresholds(cluster) -> tuple[int, int, int]:
    (th,) = cluster.circuit_breakers.thresholds
    return th.max_connections.value, th.max_pending_requests.value, th.max_requests.value


def test_every_circuit_breaker_threshold_is_set_from_the_config():
    """Issue 15 item 12: left unset, Envoy's 1024 applies to the inference clusters and to the
    picker's (one ext_proc stream per request in flight)."""
    clusters = _clusters(CFG)
    assert _thresholds(clusters["llm-v1"]) == (100_000, 100_000, 100_000)
    assert clusters["llm-v1"].circuit_breakers.thresholds[0].retry_budget.budget_percent.value == 25
    assert _thresholds(clusters[EXT_PROC_CLUSTER]) == (3 * 200_000,) * 3  # 3 clusters x (requests + pending)
    custom = config(CFG.model_dump()["services"], envoy={
        "circuit_breakers": {"max_connections": 500, "max_pending_requests": 50, "max_requests": 2000},
        "picker_circuit_breakers": {"max_connections": 4, "max_pending_requests": 5, "max_requests": 6}})
    clusters = _clusters(custom)
    assert _thresholds(clusters["embed-e1"]) == (500, 50, 2000)
    assert _thresholds(clusters[EXT_PROC_CLUSTER]) == (4, 5, 6)
