"""The picker's config: the `picker` section, mixes, and what the listener tells Envoy about them."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from ext_proc.settings import from_wire, to_wire
from inferlb.picker_config import picker_settings, routing_table
from tests.support.factories import config, service, version
from xds_server.config import ConfigError
from xds_server.resources.listener import build_listener
from xds_server.resources.routes import build_route_config


def two_versions(**extra) -> dict:
    return service("llm", [version("v1", 2), version("v2", 1)], **extra)


def test_mixes_become_the_pickers_split_and_the_fallback_routes_weighted_clusters():
    cfg = config([two_versions(default_version="stable", mixes={"stable": {"v1": 90, "v2": 10}})])
    route = routing_table(cfg).services[0]
    assert route.default_version == "stable"
    assert route.mixes["stable"] == ((9000, "llm-v1"), (10000, "llm-v2"))
    rds = json_format.MessageToDict(build_route_config(cfg))
    fallback = rds["virtualHosts"][0]["routes"][-1]["route"]["weightedClusters"]["clusters"]
    assert fallback == [{"name": "llm-v1", "weight": 9000}, {"name": "llm-v2", "weight": 1000}]


@pytest.mark.parametrize(("mixes", "needle"), [
    ({"v1": {"v1": 100}}, "name of its own"),
    ({"m": {"v3": 100}}, "must name versions"),
    ({"m": {"v1": 60, "v2": 60}}, "summing to 100"),
])
def test_bad_mixes_name_the_problem(mixes, needle):
    with pytest.raises(ConfigError, match=needle):
        config([two_versions(mixes=mixes)])


def test_default_version_may_not_be_an_unknown_mix():
    with pytest.raises(ConfigError, match="default_version"):
        config([two_versions(default_version="nope", mixes={"stable": {"v1": 100}})])


def test_model_names_reach_the_picker_and_survive_the_wire():
    """``services[].models`` reach the picker's route, and a standalone picker (fed over ADS) too."""
    cfg = config([two_versions(models=["llama-3-8b"])])
    routing = routing_table(cfg)
    assert routing.services[0].models == frozenset({b"llama-3-8b"})
    back, _ = from_wire(to_wire(routing, picker_settings(cfg)))
    assert back.services[0].models == frozenset({b"llama-3-8b"})


@pytest.mark.parametrize(("models", "needle"), [(["v1"], "already a version"), ([" "], "non-empty")])
def test_bad_model_names_name_the_problem(models, needle):
    with pytest.raises(ConfigError, match=needle):
        config([two_versions(models=models)])


def hcm(cfg) -> dict:
    listener = json_format.MessageToDict(build_listener(cfg))
    return listener["filterChains"][0]["filters"][0]["typedConfig"]


def test_the_listener_logs_every_request_to_the_picker():
    """Also those the picker's answer did not reach in time (no cluster header): their request id
    releases the pick."""
    cfg = config(picker={"access_log_flush_s": 0.02, "access_log_buffer_bytes": 4096})
    [log] = hcm(cfg)["accessLog"]
    common = log["typedConfig"]["commonConfig"]
    assert common["grpcService"]["envoyGrpc"]["clusterName"] == "inferlb_ext_proc"
    assert common["bufferFlushInterval"] == "0.020s" and common["bufferSizeBytes"] == 4096
    assert "filter" not in log
    assert log["typedConfig"]["additionalRequestHeadersToLog"] == ["x-inferlb-cluster",
                                                                   "x-gateway-destination-endpoint"]


def test_body_routing_is_on_by_default_and_lets_the_picker_ask_for_bodies():
    ext = lambda cfg: hcm(cfg)["httpFilters"][0]["typedConfig"]  # noqa: E731
    assert not ext(config(picker={"body_max_bytes": 0})).get("allowModeOverride")
    on = config()
    assert routing_table(on).body_max_bytes == 1024 * 1024   # Envoy's default buffer limit
    assert ext(on)["allowModeOverride"] is True
    assert ext(on)["processingMode"].get("requestBodyMode", "NONE") == "NONE"


def test_cost_aware_affinity_reaches_the_picker_and_is_off_by_default():
    def steps(routing):
        return [s.plugin for s in routing.profiles["default"].steps]

    assert "affinity-slack" not in steps(routing_table(config()))
    routing = routing_table(config(picker={"cost_aware_affinity": True}))
    slack = next(s for s in routing.profiles["default"].steps if s.plugin == "affinity-slack")
    assert slack.params.cost_aware is True and slack.params.slack is None
    assert from_wire(to_wire(routing, picker_settings(config())))[0].profiles == routing.profiles
    with pytest.raises(ConfigError, match="cost_aware_affinity"):
        config(picker={"cost_aware_affinity": "yes"})


def test_the_pickers_protocol_reaches_a_standalone_picker_and_bad_ones_are_refused():
    assert routing_table(config()).protocol == "inferlb"
    routing = routing_table(config(picker={"protocol": "gateway-api"}))
    assert routing.protocol == "gateway-api"
    assert from_wire(to_wire(routing, picker_settings(config())))[0].protocol == "gateway-api"
    with pytest.raises(ConfigError, match=r"picker\.protocol"):
        config(picker={"protocol": "epp"})
