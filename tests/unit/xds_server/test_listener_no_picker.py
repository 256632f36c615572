"""``envoy.picker: false``: the listener without the ext_proc picker (EDS weights only).

Structure checked in Python; the real Envoy binary (``--mode validate``) checks it accepts the
listener and routes. That such an Envoy really routes by the version header is asserted against
a running Envoy by the quality-benchmark smoke test (``inferlb_eds`` in the ``versions`` scenario).
"""

from __future__ import annotations

import json

import pytest

from tests.support.factories import config, service, version
from tests.unit.xds_server.test_bootstrap import as_dict, envoy_validate, hcm_of, render, with_xds_resources_inline
from xds_server.resources.listener import build_listener
from xds_server.resources.routes import build_route_config

SERVICES = [service("llm", [version("v1", 2), version("v2", 2), version("v3", 1)], default_version="v2")]
WITH = config(SERVICES, headers={"version": "x-model-ver", "cluster": "x-test-cluster"})
WITHOUT = config(SERVICES, headers={"version": "x-model-ver", "cluster": "x-test-cluster"},
                 envoy={"picker": False, "route_timeout_s": 7})


def test_picker_is_on_by_default():
    assert WITH.envoy.picker is True
    names = [f["name"] for f in hcm_of(as_dict(build_listener(WITH)))["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]


def test_without_picker_the_listener_has_no_ext_proc_filter_but_still_strips_routing_headers():
    hcm = hcm_of(as_dict(build_listener(WITHOUT)))
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    [strip] = hcm["early_header_mutation_extensions"]
    removed = [m["remove"] for m in strip["typed_config"]["mutations"]]
    assert removed == ["x-gateway-destination-endpoint", "x-test-cluster"]


def test_without_picker_one_route_per_version_by_exact_header_then_the_default():
    [vh] = as_dict(build_route_config(WITHOUT))["virtual_hosts"]
    served = len(json.loads(vh["routes"][0]["direct_response"]["body"]["inline_string"])["data"])
    models, *by_name, other = vh["routes"][:served + 2]  # the list, each name's entry, any other name
    *by_version, unknown, last = vh["routes"][served + 4:]  # after the other methods' 405s
    assert unknown["match"]["headers"] == [{"name": "x-model-ver", "present_match": True}]
    assert unknown["direct_response"]["status"] == 400
    assert models["match"]["path"] == "/v1/models" and served == 3
    assert [r["match"]["path"] for r in by_name] == ["/v1/models/v1", "/v1/models/v2", "/v1/models/v3"]
    assert other["match"]["prefix"] == "/v1/models/" and other["direct_response"]["status"] == 404
    assert [(r["match"]["headers"], r["route"]["cluster"]) for r in by_version] == [
        ([{"name": "x-model-ver", "string_match": {"exact": v}}], f"llm-{v}") for v in ("v1", "v2", "v3")
    ]
    assert "headers" not in last["match"] and last["route"]["cluster"] == "llm-v2"
    assert {r["route"]["timeout"] for r in [*by_version, last]} == {"7s"}
    assert not any("cluster_header" in r["route"] for r in [*by_version, last])


def test_without_picker_a_mix_or_model_name_in_the_version_header_is_routed_and_any_other_value_is_a_400():
    cfg = config([service("llm", [version("v1", 1), version("v2", 1)], default_version="v1",
                          models=["llama"], mixes={"canary": {"v1": 90, "v2": 10}})], envoy={"picker": False})
    routes = as_dict(build_route_config(cfg))["virtual_hosts"][0]["routes"]
    by_header = {r["match"]["headers"][0].get("string_match", {}).get("exact"): r for r in routes if "headers" in
                 r["match"] and r["match"]["headers"][0]["name"] == "model-version"}
    assert by_header["canary"]["route"]["weighted_clusters"]["clusters"] == [
        {"name": "llm-v1", "weight": 9000}, {"name": "llm-v2", "weight": 1000}]   # in 1/100 of a percent
    assert by_header["v2"]["route"]["cluster"] == "llm-v2"
    assert by_header["llama"]["route"]["cluster"] == "llm-v1"   # a model name: the default version
    assert json.loads(by_header[None]["direct_response"]["body"]["inline_string"])["error"]["message"] == \
        "unknown model version in header 'model-version'; known versions: canary, llama, v1, v2"


def test_picker_field_must_be_a_boolean():
    from xds_server.config import ConfigError

    with pytest.raises(ConfigError, match=r"envoy\.picker"):
        config(SERVICES, envoy={"picker": "sometimes"})


@pytest.mark.integration
def test_real_envoy_accepts_the_listener_and_routes_without_picker(tmp_path):
    result = envoy_validate(with_xds_resources_inline(WITHOUT, render()), tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
