"""What Envoy gets: the bootstrap (node, admin, ADS) and the LDS/RDS/CDS resources for the listener.

The structure is checked in Python; the real Envoy binary (``--mode validate``) checks that Envoy
accepts the bootstrap and the listener, routes and clusters we would send it.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from google.protobuf import json_format

from inferlb.devstack.stack import envoy_binary
from tests.support.factories import config, service, version
from xds_server.config import ConfigError, parse_config
from xds_server.resources.bootstrap import render_bootstrap
from xds_server.resources.build import build_snapshot
from xds_server.resources.listener import build_listener
from xds_server.resources.names import EXT_PROC_CLUSTER, ROUTE_NAME
from xds_server.resources.routes import build_route_config
from xds_server.snapshot import CLUSTER_TYPE

HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"

CFG = config(
    [
        service("llm", [version("v1", 2), version("v2", 2)], hosts=["api.example.com"], default_version="v2"),
        service("embed", [version("e1", 1)]),  # hosts "*"
    ],
    headers={"override_host": "x-test-pin", "cluster": "x-test-cluster"},
    envoy={"listener": "127.0.0.1:10555", "route_timeout_s": 30},
)


def render(**kw) -> dict:
    args = {"xds_address": "127.0.0.1:18000", "node_id": "envoy-1", "admin_port": 9901} | kw
    return yaml.safe_load(render_bootstrap(**args))


def as_dict(msg) -> dict:
    """The message as plain JSON data (Any fields with their "@type"), field names as in the .proto."""
    return json.loads(json_format.MessageToJson(msg, preserving_proto_field_name=True))


def hcm_of(listener: dict) -> dict:
    [chain] = listener["filter_chains"]
    [net] = chain["filters"]
    assert net["name"] == "envoy.filters.network.http_connection_manager"
    assert net["typed_config"]["@type"] == HCM_TYPE
    return net["typed_config"]


# --- the bootstrap --------------------------------------------------------------------------------


def test_bootstrap_is_yaml_with_node_and_admin():
    b = render(node_id="edge-7", node_cluster="gw", admin_port=9911)
    assert b["node"] == {"id": "edge-7", "cluster": "gw"}
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9911}


def test_bootstrap_uses_ads_for_everything():
    dyn = render()["dynamic_resources"]
    ads = dyn["ads_config"]
    assert ads["api_type"] == "GRPC"
    assert ads["transport_api_version"] == "V3"
    assert [g["envoy_grpc"]["cluster_name"] for g in ads["grpc_services"]] == ["inferlb_xds"]
    assert "ads" in dyn["cds_config"] and dyn["cds_config"]["resource_api_version"] == "V3"
    assert "ads" in dyn["lds_config"] and dyn["lds_config"]["resource_api_version"] == "V3"


def test_xds_cluster_is_static_http2_at_the_ads_address():
    [xds] = render(xds_address="10.1.2.3:18123")["static_resources"]["clusters"]
    assert xds["name"] == "inferlb_xds" and xds["type"] == "STATIC"
    opts = xds["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    sa = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert sa == {"address": "10.1.2.3", "port_value": 18123}


@pytest.mark.parametrize("wildcard", ["0.0.0.0:18000", "[::]:18000"])
def test_wildcard_xds_host_is_dialled_on_loopback(wildcard):
    [xds] = render(xds_address=wildcard)["static_resources"]["clusters"]
    sa = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert sa["address"] == "127.0.0.1"


@pytest.mark.parametrize(("address", "host", "kind"), [("inferlb.svc:18000", "inferlb.svc", "STRICT_DNS"),
                                                      ("[fd00::1]:18000", "fd00::1", "STATIC")])
def test_a_host_name_makes_the_xds_cluster_strict_dns(address, host, kind):
    [xds] = render(xds_address=address)["static_resources"]["clusters"]
    assert xds["type"] == kind   # Envoy refuses a host name in a STATIC cluster
    sa = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert sa == {"address": host, "port_value": 18000}


def test_cli_xds_address_overrides_the_config_listen_address(tmp_path):
    from click.testing import CliRunner

    from inferlb.cli import main

    cfg_path = tmp_path / "inferlb.yaml"
    cfg_path.write_text(yaml.safe_dump({"listen": {"xds": "0.0.0.0:18000"}, "services": [{"name": "chat", "versions": [
        {"name": "v1", "endpoints": [{"address": "10.0.0.1:8000"}]}]}]}))
    args = ["bootstrap", "-c", str(cfg_path), "--node-id", "edge-1"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0 and plain.output == render_bootstrap(xds_address="127.0.0.1:18000", node_id="edge-1",
                                                                      admin_port=9901) + "\n"
    out = CliRunner().invoke(main, [*args, "--xds-address", "10.9.8.7:18001"])
    assert out.exit_code == 0, out.output
    assert out.output == render_bootstrap(xds_address="10.9.8.7:18001", node_id="edge-1", admin_port=9901) + "\n"
    named = CliRunner().invoke(main, ["bootstrap", "--node-id", "e", "--xds-address", "inferlb.example:18000"])
    assert yaml.safe_load(named.output)["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"


def test_names_are_escaped_not_injected():
    nasty = 'a"b: c\n  evil: {x: 1}'
    b = render(node_id=nasty, node_cluster="#not-a-comment")
    assert b["node"] == {"id": nasty, "cluster": "#not-a-comment"}


# --- the listener (LDS) ---------------------------------------------------------------------------


def test_early_header_mutation_removes_both_routing_headers():
    hcm = hcm_of(as_dict(build_listener(CFG)))
    [ext] = hcm["early_header_mutation_extensions"]
    assert ext["name"] == "envoy.http.early_header_mutation.header_mutation"
    removed = [m["remove"] for m in ext["typed_config"]["mutations"]]
    assert sorted(removed) == ["x-test-cluster", "x-test-pin"]


def test_ext_proc_filter_fails_open_and_runs_before_the_router():
    hcm = hcm_of(as_dict(build_listener(CFG)))
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    assert ext["grpc_service"]["envoy_grpc"]["cluster_name"] == EXT_PROC_CLUSTER
    mode = ext["processing_mode"]
    assert mode["request_header_mode"] == "SEND"
    assert mode.get("response_header_mode") == "SKIP"
    assert mode.get("request_body_mode", "NONE") == "NONE"


def test_fail_closed_when_configured():
    cfg = config(envoy={"failure_mode_allow": False})
    ext = hcm_of(as_dict(build_listener(cfg)))["http_filters"][0]["typed_config"]
    assert ext.get("failure_mode_allow", False) is False


def test_listener_binds_the_configured_address_and_takes_routes_over_ads():
    lst = as_dict(build_listener(CFG))
    assert lst["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10555}
    rds = hcm_of(lst)["rds"]
    assert rds["route_config_name"] == ROUTE_NAME
    assert "ads" in rds["config_source"]


# --- the routes (RDS) -----------------------------------------------------------------------------


def after_models(routes: list[dict]) -> list[dict]:
    """The routes after the models' (``GET /v1/models``, each listed name, any other name, then any
    other method)."""
    last = max(i for i, r in enumerate(routes) if r["match"].get("prefix") == "/v1/models/")
    return routes[last + 1:]


def test_one_virtual_host_per_service_cluster_header_first_then_versions_then_default_version():
    """Cluster header (the picker's) first; then the version header straight to its cluster (so versions
    don't mix while the picker is down); then any other version header value a 400; then the default
    version."""
    rc = as_dict(build_route_config(CFG))
    assert rc["name"] == ROUTE_NAME
    assert rc.get("validate_clusters") is False
    vhosts = rc["virtual_hosts"]
    assert [v["name"] for v in vhosts] == ["llm", "embed"]
    expected_default = {"llm": "llm-v2", "embed": "embed-e1"}
    expected_versions = {"llm": {"v1": "llm-v1", "v2": "llm-v2"}, "embed": {"e1": "embed-e1"}}
    version_header = CFG.headers.version
    for vh in vhosts:
        models = vh["routes"][0]
        first, *by_version, unknown, last = after_models(vh["routes"])
        assert models["match"]["path"] == "/v1/models" and models["direct_response"]["status"] == 200
        assert unknown["match"]["headers"] == [{"name": version_header, "present_match": True}]
        assert unknown["direct_response"]["status"] == 400 and "route" not in unknown
        assert json.loads(unknown["direct_response"]["body"]["inline_string"]) == {"error": {
            "message": f"unknown model version in header '{version_header}'; known versions: "
                       + ", ".join(expected_versions[vh["name"]]),
            "type": "invalid_request_error", "param": version_header, "code": "unknown_version"}}
        assert first["match"]["prefix"] == "/"
        assert first["match"]["headers"] == [{"name": "x-test-cluster", "present_match": True}]
        assert first["route"]["cluster_header"] == "x-test-cluster"
        assert {r["match"]["headers"][0]["string_match"]["exact"]: r["route"]["cluster"] for r in by_version} \
            == expected_versions[vh["name"]]
        assert all(r["match"]["headers"][0]["name"] == version_header for r in by_version)
        assert "headers" not in last["match"] and last["match"]["prefix"] == "/"
        assert last["route"]["cluster"] == expected_default[vh["name"]]
        routed = [r for r in vh["routes"][1:] if "route" in r]
        assert {r["route"]["timeout"] for r in routed} == {"30s"}
        assert all(r["route"]["retry_policy"]["retry_on"] == "5xx" for r in routed)
    assert sorted(vhosts[0]["domains"]) == ["api.example.com", "api.example.com:*"]
    assert vhosts[1]["domains"] == ["*"]


GONE = config(
    [service("llm", [version("v1", 2)], default_version="v2", unavailable_versions=["v2", "v3"])],
    headers={"cluster": "x-test-cluster"},
)


def test_a_version_with_no_endpoints_is_a_503_from_envoy_never_another_version():
    """Every node of the default version v2 left (discovery): without the picker, a request naming v2 or
    none gets Envoy's own 503 naming the version, not v1's model."""
    routes = as_dict(build_route_config(GONE))["virtual_hosts"][0]["routes"]
    by_version = {r["match"]["headers"][0]["string_match"]["exact"]: r for r in after_models(routes)[1:-2]}
    assert routes[-2]["direct_response"]["status"] == 400   # any other version: unknown
    assert by_version["v1"]["route"]["cluster"] == "llm-v1"
    for v in ("v2", "v3"):
        assert "route" not in by_version[v] and by_version[v]["direct_response"]["status"] == 503
        assert json.loads(by_version[v]["direct_response"]["body"]["inline_string"]) == {"error": {
            "message": f"model version '{v}' of service 'llm' has no endpoints now", "type": "server_error",
            "param": "model-version", "code": "version_unavailable"}}
    last = routes[-1]
    assert "headers" not in last["match"] and "route" not in last
    assert last["direct_response"]["status"] == 503 and "'v2'" in last["direct_response"]["body"]["inline_string"]
    # Not served now, not listed: v2 is gone (and with it the names of the default version).
    models = json.loads(routes[0]["direct_response"]["body"]["inline_string"])
    assert [m["id"] for m in models["data"]] == ["v1"]


def test_get_v1_models_is_answered_by_envoy_with_every_served_name_and_no_picker_call():
    cfg = config([service("llm", [version("v1", 1), version("v2", 1)], default_version="v2",
                          models=["llama-3-8b"], mixes={"stable": {"v1": 90, "v2": 10}})])
    [route, *_] = as_dict(build_route_config(cfg))["virtual_hosts"][0]["routes"]
    assert route["match"] == {"path": "/v1/models",
                              "headers": [{"name": ":method", "string_match": {"safe_regex": {"regex": "GET|HEAD"}}}]}
    assert route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert {"header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} in route["response_headers_to_add"]
    listed = json.loads(route["direct_response"]["body"]["inline_string"])
    assert listed["object"] == "list"
    # Any other method under /v1/models: a 405 naming the two it takes, from Envoy, not a backend's view.
    refusals = [r for r in as_dict(build_route_config(cfg))["virtual_hosts"][0]["routes"]
                if r.get("direct_response", {}).get("status") == 405]
    assert [r["match"] for r in refusals] == [{"path": "/v1/models"}, {"prefix": "/v1/models/"}]
    for r in refusals:
        assert {"header": {"key": "allow", "value": "GET, HEAD"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} in r["response_headers_to_add"]
        assert r["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
        assert json.loads(r["direct_response"]["body"]["inline_string"])["error"]["code"] == "method_not_allowed"
    assert [(m["id"], m["object"], m["owned_by"], m["root"]) for m in listed["data"]] == [
        ("llama-3-8b", "model", "llm", "v2"), ("v1", "model", "llm", "v1"), ("v2", "model", "llm", "v2"),
        ("stable", "model", "llm", "stable")]


# --- the real Envoy -------------------------------------------------------------------------------


def envoy_validate(doc: dict, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "warn"],
        capture_output=True, text=True, timeout=60,
    )


def with_xds_resources_inline(cfg, bootstrap: dict) -> dict:
    """The bootstrap plus, as static resources, the listener (routes inline) and every CDS cluster."""
    listener = as_dict(build_listener(cfg))
    hcm = hcm_of(listener)
    del hcm["rds"]
    hcm["route_config"] = as_dict(build_route_config(cfg))
    snap = build_snapshot(cfg, [], "127.0.0.1:18080")
    clusters = [as_dict(r.packed) for r in snap.of(CLUSTER_TYPE).values()]
    for c in clusters:
        c.pop("@type")
    bootstrap["static_resources"]["listeners"] = [listener]
    bootstrap["static_resources"]["clusters"] += clusters
    del bootstrap["dynamic_resources"]["lds_config"]
    del bootstrap["dynamic_resources"]["cds_config"]
    return bootstrap


@pytest.mark.integration
def test_real_envoy_accepts_the_bootstrap(tmp_path):
    result = envoy_validate(render(), tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_delta_bootstrap_asks_for_delta_ads_and_raises_the_message_limit():
    ads = render(delta=True)["dynamic_resources"]["ads_config"]
    assert ads["api_type"] == "DELTA_GRPC"
    [svc] = ads["grpc_services"]
    assert svc["envoy_grpc"]["max_receive_message_length"] == 64 * 1024 * 1024
    assert render()["dynamic_resources"]["ads_config"]["grpc_services"] == ads["grpc_services"]


@pytest.mark.integration
def test_real_envoy_accepts_the_cli_delta_bootstrap(tmp_path):
    """``inferlb bootstrap --delta`` output goes straight into ``envoy --mode validate``."""
    from click.testing import CliRunner

    from inferlb.cli import main

    cfg_path = tmp_path / "inferlb.yaml"
    cfg_path.write_text(yaml.safe_dump({"services": [{"name": "chat", "versions": [
        {"name": "v1", "endpoints": [{"address": "10.0.0.1:8000"}]}]}]}))
    out = CliRunner().invoke(main, ["bootstrap", "-c", str(cfg_path), "--node-id", "edge-1", "--delta"])
    assert out.exit_code == 0, out.output
    doc = yaml.safe_load(out.output)
    assert doc["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"
    result = envoy_validate(doc, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.integration
def test_real_envoy_accepts_the_listener_routes_and_clusters(tmp_path):
    doc = with_xds_resources_inline(CFG, render())
    assert len(doc["static_resources"]["clusters"]) == 1 + 1 + 3  # xds, ext_proc, three versions
    result = envoy_validate(doc, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.integration
def test_real_envoy_accepts_the_routes_of_a_version_with_no_endpoints(tmp_path):
    result = envoy_validate(with_xds_resources_inline(GONE, render()), tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.integration
def test_real_envoy_rejects_a_broken_document(tmp_path):
    """The validation above can fail: a duplicate cluster name is refused."""
    doc = render()
    doc["static_resources"]["clusters"].append(dict(doc["static_resources"]["clusters"][0]))
    assert envoy_validate(doc, tmp_path).returncode != 0


TWO_WILDCARD_SERVICES = """
services:
  - name: chat
    versions: [{name: v1, endpoints: [{address: 10.0.0.1:8000}]}]
  - name: embed
    versions: [{name: v1, endpoints: [{address: 10.0.0.2:8000}]}]
"""

TWO_SAME_HOST_SERVICES = """
services:
  - name: chat
    hosts: [api.example.com]
    versions: [{name: v1, endpoints: [{address: 10.0.0.1:8000}]}]
  - name: embed
    hosts: [api.example.com]
    versions: [{name: v1, endpoints: [{address: 10.0.0.2:8000}]}]
"""


@pytest.mark.integration
@pytest.mark.parametrize("text", [TWO_WILDCARD_SERVICES, TWO_SAME_HOST_SERVICES], ids=["both-star", "same-host"])
def test_a_config_that_validates_gives_routes_envoy_accepts(text, tmp_path):
    try:
        cfg = parse_config(text)
    except ConfigError as err:  # refusing the config up front is a fine fix too
        assert "hosts" in str(err)
        return
    result = envoy_validate(with_xds_resources_inline(cfg, render()), tmp_path)
    assert result.returncode == 0, result.stderr[-500:] + result.stdout[-500:]


@pytest.mark.parametrize(("name", "delta"), [("bootstrap-sotw.yaml", False), ("bootstrap-delta.yaml", True)])
def test_example_bootstraps_are_what_the_command_prints(name, delta):
    from pathlib import Path

    from click.testing import CliRunner

    from inferlb.cli import main

    example = Path(__file__).resolve().parents[3] / "envoy" / name
    run = CliRunner().invoke(main, ["bootstrap", "--node-id", "edge-1", *(["--delta"] if delta else [])])
    assert run.exit_code == 0, run.output
    assert run.output == example.read_text()
