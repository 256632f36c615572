"""The pure picker: version routing, session pinning, health, host selection, hostile input."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.body import BodyFields
from ext_proc.picker import Decision, pick
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder, pinnable_endpoints

HEALTHY = health_check_pb2.HEALTHY
UNKNOWN = health_check_pb2.UNKNOWN


def cla(
    name: str, hosts: Iterable[tuple[str, int]], port: int = 8000, priority: int = 0
) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment with one locality; hosts are (ip, health_status)."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    locality = assignment.endpoints.add(priority=priority)
    for ip, health in hosts:
        lb = locality.lb_endpoints.add(health_status=health)
        lb.endpoint.address.socket_address.address = ip
        lb.endpoint.address.socket_address.port_value = port
    return assignment


LLM = ServiceRoute("llm", ("api.example.com",), "v1", {"v1": "llm-v1", "v2": "llm-v2"}, affinity="soft")
EMBED = ServiceRoute("embed", ("embed.example.com", "vectors.example.com"), "e1", {"e1": "embed-e1"}, affinity="soft")
ROUTING = RoutingTable(services=(LLM, EMBED))

V1 = [(f"10.0.1.{i}", HEALTHY) for i in range(4)]
V2 = [(f"10.0.2.{i}", UNKNOWN) for i in range(4)]


def make_view(assignments=None, routing: RoutingTable = ROUTING) -> EndpointView:
    if assignments is None:
        assignments = {
            "llm-v1": cla("llm-v1", V1),
            "llm-v2": cla("llm-v2", V2),
            "embed-e1": cla("embed-e1", [("10.0.3.1", HEALTHY)]),
        }
    return EndpointView.build(assignments, routing)


VIEW = make_view()


def req(host: bytes = b"api.example.com", **headers: bytes) -> dict[str, bytes]:
    out = {":authority": host, ":method": b"POST", ":path": b"/v1/chat/completions"}
    out.update({k.replace("_", "-"): v for k, v in headers.items()})
    return out


# --- version routing (C14) -------------------------------------------------------------------


@pytest.mark.parametrize(("version", "cluster"), [(b"v1", "llm-v1"), (b"v2", "llm-v2")])
def test_known_version_routes_to_its_cluster(version, cluster):
    d = pick(req(model_version=version), VIEW)
    assert (d.cluster, d.status, d.reason, d.key) == (cluster, None, "least-loaded", "none")
    assert d.endpoint.startswith("10.0.1." if version == b"v1" else "10.0.2.") and not d.rejected


@pytest.mark.parametrize("headers", [req(), req(model_version=b"")])
def test_missing_or_empty_version_uses_the_default(headers):
    d = pick(headers, VIEW)
    assert d.cluster == "llm-v1" and d.status is None


def test_unknown_version_is_a_400_naming_bad_and_known_versions():
    d = pick(req(model_version=b"v9", x_session_id=b"s1"), VIEW)
    assert d.rejected and d.status == 400 and d.reason == "unknown-version"
    assert d.cluster is None and d.endpoint is None
    assert json.loads(d.body) == {"error": {
        "message": "unknown model version 'v9' in header 'model-version'; known versions: v1, v2",
        "type": "invalid_request_error", "param": "model-version", "code": "unknown_version"}}


def test_a_version_with_no_endpoints_is_a_503_naming_it_never_another_version():
    """Every node of the default version v2 left: a request naming none (or its model name, or v2)
    gets 503 "version-unavailable"; one naming v1 is routed as before."""
    llm = ServiceRoute("llm", ("api.example.com",), "v2", {"v1": "llm-v1"}, models=frozenset({b"m"}),
                       unavailable=frozenset({"v2"}), affinity="soft")
    view = make_view(routing=RoutingTable(services=(llm, EMBED)))
    for headers in (req(), req(model_version=b"v2", x_session_id=b"s1"), req(model_version=b"m")):
        d = pick(headers, view)
        assert (d.status, d.reason, d.cluster, d.endpoint) == (503, "version-unavailable", None, None)
        assert json.loads(d.body)["error"]["message"] == "model version 'v2' of service 'llm' has no endpoints now"
    assert pick(req(model_version=b"v1"), view).cluster == "llm-v1"
    assert pick(req(model_version=b"v9"), view).reason == "unknown-version"


def test_a_model_name_of_the_service_means_its_default_version():
    """OpenAI clients always send ``model``: the served model name routes like no version at all."""
    llm = ServiceRoute("llm", ("api.example.com",), "v1", {"v1": "llm-v1", "v2": "llm-v2"},
                       models=frozenset({b"llama-3-8b"}), affinity="soft")
    view = make_view(routing=RoutingTable(services=(llm, EMBED)))
    assert pick(req(), view, body=BodyFields(model=b"llama-3-8b")).cluster == "llm-v1"
    assert pick(req(model_version=b"llama-3-8b"), view).cluster == "llm-v1"
    assert pick(req(), view, body=BodyFields(model=b"v2")).cluster == "llm-v2"
    d = pick(req(), view, body=BodyFields(model=b"gpt-4"))
    assert d.status == 404 and d.reason == "model-not-found"
    assert json.loads(d.body) == {"error": {
        "message": "The model 'gpt-4' does not exist here; served models: llama-3-8b, v1, v2",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    # The version header is inferlb's own: an unknown one stays a 400 naming the versions.
    assert pick(req(model_version=b"gpt-4"), view).status == 400
    # An empty model is no served name either (it went to the default version before).
    d = pick(req(), view, body=BodyFields(model=b""))
    assert (d.status, d.reason, json.loads(d.body)["error"]["param"]) == (404, "model-not-found", "model")
    assert pick(req(model_version=b"v2"), view, body=BodyFields(model=b"")).cluster == "llm-v2"  # the header decides


def test_a_service_that_lists_no_models_serves_any_body_model_from_its_default_version():
    """It cannot tell a served name from another: only a version or mix name in ``model`` routes."""
    assert pick(req(), VIEW, body=BodyFields(model=b"whatever-7b")).cluster == "llm-v1"
    assert pick(req(), VIEW, body=BodyFields(model=b"v2")).cluster == "llm-v2"
    assert pick(req(), VIEW, body=BodyFields(model=b"\xff")).cluster == "llm-v1"
    assert pick(req(), VIEW, body=BodyFields(model=b"")).cluster == "llm-v1"


def test_the_404_leaves_out_names_not_served_now():
    gone = ServiceRoute("llm", ("api.example.com",), "v2", {"v1": "llm-v1"}, mixes={},
                        models=frozenset({b"llama-3-8b"}), unavailable=frozenset({"v2"}), affinity="soft")
    view = make_view(routing=RoutingTable(services=(gone, EMBED)))
    d = pick(req(), view, body=BodyFields(model=b"gpt-4"))
    assert json.loads(d.body)["error"]["message"].endswith("served models: v1")


def test_version_of_another_service_is_unknown_here():
    d = pick(req(model_version=b"e1"), VIEW)
    assert d.status == 400 and "'e1'" in json.loads(d.body)["error"]["message"]


def test_custom_version_header_name():
    routing = RoutingTable(version_header="X-Model", services=(LLM,))
    view = make_view(routing=routing)
    assert pick(req(x_model=b"v2"), view).cluster == "llm-v2"
    assert pick(req(model_version=b"v2"), view).cluster == "llm-v1"  # other header ignored
    assert "header 'x-model'" in json.loads(pick(req(x_model=b"zz"), view).body)["error"]["message"]


# --- sessions ---------------------------------------------------------------------------------


def test_session_is_pinned_and_sticky():
    first = pick(req(x_session_id=b"alice"), VIEW)
    assert first.reason == "affinity" and first.key == "session" and first.cluster == "llm-v1"
    assert first.endpoint in {f"{ip}:8000" for ip, _ in V1}
    for _ in range(20):
        assert pick(req(x_session_id=b"alice"), VIEW) == first
    # A rebuilt view (another process, another update) pins the same endpoint.
    assert pick(req(x_session_id=b"alice"), make_view()).endpoint == first.endpoint


def test_sessions_spread_over_the_cluster():
    pinned = {pick(req(x_session_id=b"user-%d" % i), VIEW).endpoint for i in range(200)}
    assert pinned == {f"{ip}:8000" for ip, _ in V1}


def test_session_headers_in_order_first_non_empty_wins():
    by_user = pick(req(x_user_id=b"bob"), VIEW)
    assert by_user.reason == "affinity"
    assert pick(req(x_session_id=b"", x_user_id=b"bob"), VIEW).endpoint == by_user.endpoint
    keys = [b"s-%d" % i for i in range(50)]
    both = [pick(req(x_session_id=k, x_user_id=b"bob"), VIEW).endpoint for k in keys]
    alone = [pick(req(x_session_id=k), VIEW).endpoint for k in keys]
    assert both == alone


def test_a_request_without_session_goes_to_the_least_loaded_endpoint():
    loads = {f"{ip}:8000": 3.0 for ip, _ in V2}
    loads["10.0.2.2:8000"] = 1.0
    for i in range(50):
        d = pick(req(model_version=b"v2", x_request_id=b"req-%d" % i), VIEW, loads=loads)
        assert (d.cluster, d.endpoint, d.reason, d.session) == ("llm-v2", "10.0.2.2:8000", "least-loaded", None)


def test_large_pools_use_two_weighted_choices():
    from ext_proc.scheduling import SCAN_MAX
    hosts = [(f"10.1.{i // 250}.{i % 250}", HEALTHY) for i in range(SCAN_MAX + 36)]
    view = make_view({"llm-v1": cla("llm-v1", hosts)})
    loads = {f"{ip}:8000": 5.0 for ip, _ in hosts}
    idle = {f"{ip}:8000" for ip, _ in hosts[:50]}
    loads.update({e: 0.0 for e in idle})
    picks = Counter(pick(req(x_request_id=b"r-%d" % i), view, loads=loads).endpoint for i in range(1000))
    # One of two draws idle: 1 - (50/100)^2 = 75 % of the picks go to the idle half.
    assert 0.68 <= sum(n for e, n in picks.items() if e in idle) / 1000 <= 0.82, picks


def test_idle_requests_without_session_follow_the_weights():
    assignment = cla("llm-v1", V1)
    for lb, w in zip(assignment.endpoints[0].lb_endpoints, (10, 30, 30, 30), strict=True):
        lb.load_balancing_weight.value = w
    view = make_view({"llm-v1": assignment})
    picks = Counter(pick(req(x_request_id=b"r-%d" % i), view).endpoint for i in range(2000))
    assert 0.06 <= picks["10.0.1.0:8000"] / 2000 <= 0.14, picks  # a slow-starting endpoint still gets its share


def test_session_on_each_version_uses_that_clusters_endpoints():
    d = pick(req(model_version=b"v2", x_session_id=b"alice"), VIEW)
    assert d.cluster == "llm-v2" and d.endpoint.startswith("10.0.2.")


def test_loads_are_plumbed_to_the_ring():
    home = pick(req(x_session_id=b"alice"), VIEW).endpoint
    loads = {f"{ip}:8000": 0 for ip, _ in V1}
    loads[home] = 100
    moved = pick(req(x_session_id=b"alice"), VIEW, loads=loads)
    assert moved.reason == "spilled" and moved.endpoint not in (None, home)


# --- health (C10, C11) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        health_check_pb2.DRAINING,
        health_check_pb2.UNHEALTHY,
        health_check_pb2.DEGRADED,
        health_check_pb2.TIMEOUT,
    ],
)
def test_unpinnable_endpoint_is_never_pinned_and_its_sessions_move(bad):
    sessions = [b"user-%d" % i for i in range(300)]
    before = {s: pick(req(x_session_id=s), VIEW).endpoint for s in sessions}
    victim = before[sessions[0]]
    hosts = [(ip, bad if f"{ip}:8000" == victim else h) for ip, h in V1]
    view = make_view({"llm-v1": cla("llm-v1", hosts)})
    after = {s: pick(req(x_session_id=s), view).endpoint for s in sessions}
    assert victim not in after.values()
    assert all(e is not None for e in after.values())
    # Only the victim's sessions moved; every other session kept its endpoint.
    for s in sessions:
        if before[s] != victim:
            assert after[s] == before[s]


def test_cluster_without_pinnable_endpoints_routes_without_pin():
    hosts = [(ip, health_check_pb2.DRAINING) for ip, _ in V1]
    view = make_view({"llm-v1": cla("llm-v1", hosts)})
    d = pick(req(x_session_id=b"alice"), view)
    assert d == Decision("llm-v1", None, None, b"", "no-healthy-endpoint")


def test_cluster_missing_from_eds_routes_without_pin():
    d = pick(req(model_version=b"v2", x_session_id=b"alice"), make_view({}))
    assert (d.cluster, d.endpoint, d.reason) == ("llm-v2", None, "no-healthy-endpoint")


def test_pinnable_endpoints_use_lowest_priority_and_skip_portless():
    assignment = cla("c", [("10.0.0.1", HEALTHY), ("10.0.0.2", health_check_pb2.DRAINING)])
    failover = assignment.endpoints.add(priority=1)
    failover.lb_endpoints.add().endpoint.address.socket_address.address = "10.9.9.9"
    lb = failover.lb_endpoints.add()
    lb.endpoint.address.socket_address.address = "10.9.9.8"
    lb.endpoint.address.socket_address.port_value = 80
    assert pinnable_endpoints(assignment) == ("10.0.0.1:8000",)
    only_failover = cla("c", [("10.0.0.1", health_check_pb2.UNHEALTHY)])
    only_failover.endpoints.add(priority=1).CopyFrom(failover)
    assert pinnable_endpoints(only_failover) == ("10.9.9.8:80",)
    assert pinnable_endpoints(cla("c", [("fd00::1", HEALTHY)])) == ("[fd00::1]:8000",)


# --- service selection by host ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("authority", "cluster"),
    [
        (b"api.example.com", "llm-v1"),
        (b"api.example.com:10000", "llm-v1"),
        (b"API.Example.COM", "llm-v1"),
        (b"embed.example.com:443", "embed-e1"),
        (b"vectors.example.com", "embed-e1"),
    ],
)
def test_service_is_chosen_by_authority_host(authority, cluster):
    assert pick(req(authority), VIEW).cluster == cluster


def test_unknown_host_is_a_404_naming_it():
    d = pick(req(b"other.example.com:8080"), VIEW)
    assert d.status == 404 and d.reason == "unknown-service"
    assert "other.example.com:8080" in json.loads(d.body)["error"]["message"]


def test_host_header_is_used_without_authority():
    headers = req()
    del headers[":authority"]
    headers["host"] = b"embed.example.com"
    assert pick(headers, VIEW).cluster == "embed-e1"


def test_wildcard_service_takes_any_host_but_earlier_services_win():
    anything = ServiceRoute("any", ("*",), "w", {"w": "wild"}, affinity="soft")
    view = make_view(routing=RoutingTable(services=(LLM, anything, EMBED)))
    assert pick(req(b"api.example.com"), view).cluster == "llm-v1"
    assert pick(req(b"whatever:1"), view).cluster == "wild"
    assert pick(req(b"embed.example.com"), view).cluster == "wild"  # shadowed by "*"
    assert pick(req(b"[::1]:10000"), view).cluster == "wild"
    assert pick({}, view).cluster == "wild"


def test_ipv6_authority_host():
    v6 = ServiceRoute("v6", ("[::1]",), "v", {"v": "c6"}, affinity="soft")
    view = make_view(routing=RoutingTable(services=(v6,)))
    assert pick(req(b"[::1]:10000"), view).cluster == "c6"
    assert pick(req(b"[::1]"), view).cluster == "c6"


# --- view and holder ----------------------------------------------------------------------------


def test_holder_starts_not_ready_and_swaps():
    holder = ViewHolder()
    d = pick(req(x_session_id=b"alice"), holder.current)
    assert d == Decision(None, None, None, b"", "not-ready")
    first = holder.update({"llm-v1": cla("llm-v1", V1)}, ROUTING)
    assert holder.current is first and pick(req(), first).cluster == "llm-v1"
    second = holder.update({"llm-v1": cla("llm-v1", V1)}, ROUTING)
    assert holder.current is second and second is not first
    assert second.clusters["llm-v1"].ring is first.clusters["llm-v1"].ring  # unchanged: reused


def test_routing_validation_names_the_field():
    with pytest.raises(ValueError, match="default_version"):
        ServiceRoute("s", ("h",), "v3", {"v1": "c"}, affinity="soft")
    with pytest.raises(ValueError, match="profiles must include 'default'"):
        RoutingTable(profiles={})
    with pytest.raises(ValueError, match="service 's' names profile 'fast'"):
        RoutingTable(services=(ServiceRoute("s", ("h",), "v1", {"v1": "c"}, profile="fast", affinity="soft"),))
    with pytest.raises(ValueError, match="hosts"):
        ServiceRoute("s", (), "v1", {"v1": "c"}, affinity="soft")


# --- hostile input ------------------------------------------------------------------------------


def test_non_utf8_version_is_a_clear_400():
    d = pick(req(model_version=b"\xff\xfe v1"), VIEW)
    assert d.status == 400 and d.reason == "invalid-version"
    message = json.loads(d.body)["error"]["message"]
    assert "not valid UTF-8" in message and "known versions: v1, v2" in message
    assert "('\\xff\\xfe v1'," in message  # each invalid byte one escape, not escaped again by a repr


def test_huge_version_is_a_clear_400():
    d = pick(req(model_version=b"v" * 10_000), VIEW)
    assert d.status == 400 and d.reason == "invalid-version"
    assert "too long (10000 bytes" in json.loads(d.body)["error"]["message"]
    assert len(d.body) < 400


def test_huge_and_binary_session_and_host_values_do_not_raise():
    assert pick(req(x_session_id=b"\x00\xff" * 5_000), VIEW).reason == "affinity"
    assert pick(req(b"\xff" * 10_000), VIEW).status == 404
    assert pick(req(b"a" * 10_000 + b":99999999999999999999"), VIEW).status == 404


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([":authority", "host", "model-version", "x-session-id", "x-user-id", "other"]),
        st.binary(max_size=300),
    )
)
def test_any_header_values_give_a_decision(headers):
    d = pick(headers, VIEW)
    assert isinstance(d, Decision)
    assert (d.status is None) == (d.cluster is not None)
    if d.status is not None:
        assert d.status in (400, 404)
        assert "error" in json.loads(d.body)
    if d.endpoint is not None:
        assert d.endpoint in VIEW.clusters[d.cluster].endpoints
