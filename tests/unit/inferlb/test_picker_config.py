"""The picker's config: the `picker` section, mixes, and what the listener tells Envoy about them."""

from __future__ import annotations

import pytest
from google.protobuf import json_format, struct_pb2

from ext_proc.prefix_events import PENDING_S
from ext_proc.scheduling import DEFAULT_STEPS, build_profile
from ext_proc.settings import from_wire, to_wire
from inferlb.picker_config import CONFIG_CHECKS, picker_settings, routing_table
from tests.support.factories import config, service, version
from xds_server.config import ConfigError, load_config
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


def test_the_default_profile_is_the_built_in_one_and_a_configured_one_reaches_a_standalone_picker():
    routing = routing_table(config())
    assert routing.profiles["default"] == build_profile(DEFAULT_STEPS)
    steps = [{"plugin": "failed-endpoints"}, {"plugin": "memory-admission"},
             {"plugin": "bounded-load", "params": {"load_factor": 1.5}},
             {"plugin": "affinity-slack", "params": {"slack": None, "cost_aware": True}},
             {"plugin": "least-loaded"}, {"plugin": "ring-affinity"}]
    routing = routing_table(config(picker={"profile": steps}))
    profile = routing.profiles["default"]
    assert [s.plugin for s in profile.steps] == [s["plugin"] for s in steps]
    assert profile.steps[2].params.load_factor == 1.5 and profile.steps[2].params.min_bound == 2.0  # its default
    assert profile.steps[3].params.cost_aware is True and profile.steps[3].params.slack is None
    struct = json_format.ParseDict(to_wire(routing, picker_settings(config())), struct_pb2.Struct())
    assert from_wire(json_format.MessageToDict(struct))[0] == routing


def test_a_service_chooses_a_named_profile():
    profiles = {"llmd": [{"plugin": "memory-admission"}, {"plugin": "session-affinity", "weight": 3},
                         {"plugin": "least-loaded", "weight": 1}, {"plugin": "max-score"}]}
    cfg = config([two_versions(picker_profile="llmd"), service("other", [version("v1", 1)], hosts=["other"])],
                 picker={"profiles": profiles})
    routing = routing_table(cfg)
    assert [s.profile for s in routing.services] == ["llmd", "default"]
    llmd = routing.profiles["llmd"]
    assert [(s.plugin, s.weight) for s in llmd.steps] == [
        ("memory-admission", None), ("session-affinity", 3.0), ("least-loaded", 1.0), ("max-score", None)]
    with pytest.raises(ConfigError, match=r"services\[0\]\.picker_profile: unknown profile 'fast'"):
        config([two_versions(picker_profile="fast")], picker={"profiles": profiles})
    with pytest.raises(ConfigError, match="the default profile is picker.profile"):
        config(picker={"profiles": {"default": profiles["llmd"]}})


@pytest.mark.parametrize(("picker", "needle"), [
    ({"profile": [{"plugin": "ring-affinity"}, {"plugin": "nope"}]},
     r"picker\.profile\[1\]\.plugin: unknown plugin 'nope'; known: affinity-slack, "),
    ({"profile": [{"plugin": "bounded-load", "params": {"load_factor": 0.5}}, {"plugin": "ring-affinity"}]},
     r"picker\.profile\[0\]\.params\.load_factor: Input should be greater than or equal to 1"),
    ({"profile": [{"plugin": "bounded-load", "params": {"c": 2}}, {"plugin": "ring-affinity"}]},
     r"picker\.profile\[0\]\.params\.c: Extra inputs are not permitted"),
    ({"profile": [{"plugin": "ring-affinity", "weight": 2}]},
     r"picker\.profile\[0\]\.weight: 'ring-affinity' is a picker: only scorers have a weight"),
    ({"profile": [{"plugin": "least-loaded"}]}, r"picker\.profile: a profile has exactly one picker"),
    ({"profile": [{"plugin": "ring-affinity"}, {"plugin": "max-score"}]}, r"exactly one picker .* got 2"),
    ({"profile": [{"plugin": "ring-affinity"}, {"plugin": "ring-affinity"}]},
     r"picker\.profile\[1\]\.plugin: 'ring-affinity' is already step 0"),
    ({"profiles": {"fast": [{"plugin": "affinity-slack", "params": {"slack": None}}, {"plugin": "max-score"}]}},
     r"picker\.profiles\.fast\[0\]\.params: Value error, slack is null and cost_aware is false"),
    ({"plugin_modules": ["no_such_module_here"]},
     r"picker\.plugin_modules\[0\]: cannot import plugin module 'no_such_module_here': ModuleNotFoundError"),
])
def test_a_bad_profile_is_refused_at_startup_naming_the_field(tmp_path, picker, needle):
    import yaml

    path = tmp_path / "inferlb.yaml"
    path.write_text(yaml.safe_dump({"services": [two_versions()], "picker": picker}))
    with pytest.raises(ConfigError, match=needle):
        load_config(path, CONFIG_CHECKS)
    with pytest.raises(ConfigError):  # and the picker's tables are never built from it
        routing_table(load_config(path))


@pytest.mark.parametrize(("old", "write"), [
    ({"load_factor": 1.5}, "{plugin: bounded-load, params: {load_factor: 1.5}}"),
    ({"pinned_load_factor": 4, "min_bound": 3},
     "{plugin: bounded-load, params: {pinned_load_factor: 4, min_bound: 3}}"),
    ({"affinity_slack": 1}, "{plugin: affinity-slack, params: {slack: 1}}"),
    ({"cost_aware_affinity": True}, "{plugin: affinity-slack, params: {cost_aware: true, slack: null}}"),
])
def test_the_knobs_the_profile_replaced_are_refused_with_what_to_write(old, write):
    with pytest.raises(ConfigError, match="removed") as err:
        config(picker=old)
    assert write in str(err.value) and all(f"picker.{name}" in str(err.value) for name in old)
    assert "{plugin: prefix-cache}" in str(err.value)  # the whole profile to write: today's with the value


def test_the_pickers_protocol_reaches_a_standalone_picker_and_bad_ones_are_refused():
    assert routing_table(config()).protocol == "inferlb"
    routing = routing_table(config(picker={"protocol": "gateway-api"}))
    assert routing.protocol == "gateway-api"
    assert from_wire(to_wire(routing, picker_settings(config())))[0].protocol == "gateway-api"
    with pytest.raises(ConfigError, match=r"picker\.protocol"):
        config(picker={"protocol": "epp"})


def test_prefix_source_kv_events_reaches_the_picker_and_survives_the_wire():
    """The engine's block size keys the prompt (the routing table), the publishers' template, topic and
    pending picks are the process's settings; a standalone picker gets them over ADS."""
    cfg = config(picker={"prefix_source": "kv_events", "prefix_cache_tokens": 64_000,
                         "kv_events": {"endpoint": "tcp://{host}:{port+1000}", "topic": "kv", "block_size": 32,
                                       "tokenizer": "/models/llama"}})
    routing, settings = routing_table(cfg), picker_settings(cfg)
    assert (routing.engine_block_size, routing.prefix_blocks, routing.engine_tokenizer) == (32, 2000, "/models/llama")
    assert (settings.prefix_source, settings.kv_events_endpoint, settings.kv_events_topic, settings.pending_s) == (
        "kv_events", "tcp://{host}:{port+1000}", "kv", PENDING_S)
    struct = json_format.ParseDict(to_wire(routing, settings), struct_pb2.Struct())
    assert from_wire(json_format.MessageToDict(struct)) == (routing, settings)
    default = config()
    assert routing_table(default).engine_block_size == 0 and picker_settings(default).prefix_source == "routing"
    assert routing_table(config(picker={"kv_events": {"tokenizer": "/m"}})).engine_tokenizer is None  # routing
    assert picker_settings(config(picker={"kv_events": {"pending_s": 0}})).pending_s == 0


@pytest.mark.parametrize(("picker", "needle"), [
    ({"prefix_source": "precise"}, "picker.prefix_source"),
    ({"kv_events": {"endpoint": "tcp://{host}:{nope}"}}, "picker.kv_events.endpoint"),
    ({"kv_events": {"endpoint": "{host}:5557"}}, "picker.kv_events.endpoint"),
    ({"kv_events": {"block_size": 0}}, "picker.kv_events.block_size"),
    ({"kv_events": {"keys": "llama"}}, "picker.kv_events.keys"),
    ({"kv_events": {"keys": "vllm"}}, "picker.kv_events: Value error, keys: vllm needs tokenizer"),
    ({"kv_events": {"pending_s": -1}}, "picker.kv_events.pending_s"),
    ({"kv_events": {"tokenizer": ""}}, "picker.kv_events.tokenizer"),
    ({"prefix_source": "kv_events", "prefix_cache_tokens": 0}, "picker.prefix_cache_tokens"),
])
def test_bad_kv_events_settings_are_refused_naming_the_field(picker, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        config(picker=picker)
