"""The ``metrics`` config section -> the sources built; the proto API compiled at import; the demo's source choice."""

from __future__ import annotations

import pytest

from inferlb.demo import choose_metrics_source, demo_config
from inferlb.devstack import stack
from tests.support.factories import config, service, version
from xds_server.config import ConfigError
from xds_server.metrics.build import build_sources
from xds_server.metrics.sources.prometheus import PrometheusSource
from xds_server.metrics.sources.scrape import ScrapeSource

EPS = [{"address": "10.0.0.1:8000", "pod": "llm-0", "namespace": "ai"},
       {"address": "10.0.0.2:8000", "pod": "llm-1", "namespace": "ai", "metrics_instance": "llm-1:8000"}]


def cfg(**metrics):
    return config([service("llm", [version("v1", EPS)])], metrics=metrics)


def test_default_is_prometheus_alone_without_fallback():
    s = build_sources(cfg())
    assert [p.name for p in s.combined.pulls] == ["prometheus"]
    assert s.scrape is None and s.push is None and s.combined.fallback is None
    assert s.combined.name == "prometheus"


def test_the_prometheus_source_gets_the_staleness_threshold():
    """It sets the range of the last-good-scrape query (2 x engine.stale_after_s)."""
    c = config([service("llm", [version("v1", EPS)])], engine={"stale_after_s": 40})
    prom = build_sources(c).combined.pulls[0]
    assert "[80s:" in prom._queries["last_good_scrape_ts"][0]


def test_all_three_sources_and_the_scrape_urls():
    s = build_sources(cfg(sources=["prometheus", "scrape", "push"], scrape={"path": "/stats", "interval_s": 2}))
    assert [p.name for p in s.combined.pulls] == ["prometheus", "scrape"]
    assert s.scrape.targets == {"10.0.0.1:8000": "http://10.0.0.1:8000/stats",
                                "llm-1:8000": "http://10.0.0.2:8000/stats"}
    assert s.scrape.interval_s == 2
    assert s.combined.fallback is None  # scrape already answers every round
    assert s.push is not None and s.combined.name == "prometheus+scrape+push"


def test_scrape_as_fallback_only():
    s = build_sources(cfg(fallback="scrape"))
    assert [p.name for p in s.combined.pulls] == ["prometheus"]
    assert isinstance(s.combined.fallback, ScrapeSource) and s.scrape is s.combined.fallback


def test_custom_promql_replaces_a_preset_query():
    s = build_sources(cfg(queries={"queue": "sum by (instance) (my_queue)", "gpu_util": "max by (instance) (u)"}))
    prom = s.combined.pulls[0]
    assert isinstance(prom, PrometheusSource)
    assert prom._queries["queue"] == ("sum by (instance) (my_queue)", 1.0, ("instance",))
    assert prom._queries["running"][0].startswith("sum by (instance) (avg_over_time(vllm:num_requests_running")


def test_gpu_series_joined_by_pod():
    s = build_sources(cfg(gpu_join="pod", preset="sglang", queries={"gpu_util": "max by (namespace, pod) (u)"}))
    prom = s.combined.pulls[0]
    assert prom._queries["gpu_mem_free_mib"][2] == ("namespace", "pod")
    assert prom._queries["gpu_util"] == ("max by (namespace, pod) (u)", 1.0, ("namespace", "pod"))
    assert prom._queries["queue"][2] == ("instance",) and "sglang:num_queue_reqs" in prom._queries["queue"][0]
    assert prom._gpu_keys == {"10.0.0.1:8000": "ai/llm-0", "llm-1:8000": "ai/llm-1"}


def test_prometheus_source_joins_gpu_answers_by_pod():
    s = build_sources(cfg(gpu_join="pod"))
    prom = s.combined.pulls[0]

    class Fake:
        def custom_query(self, query, params=None):
            if "DCGM_FI_DEV_GPU_UTIL" in query:
                return [{"metric": {"namespace": "ai", "pod": "llm-1"}, "value": [1, "70"]},
                        {"metric": {"namespace": "ai"}, "value": [1, "99"]}]  # no pod: cannot be joined
            if "timestamp" in query:
                return [{"metric": {"instance": "llm-1:8000"}, "value": [1, "100"]}]
            return []

    prom._prom = Fake()
    out = prom.fetch(["10.0.0.1:8000", "llm-1:8000"], now=101.0)
    assert out["llm-1:8000"].gpu_util == pytest.approx(0.7) and out["10.0.0.1:8000"].gpu_util is None


@pytest.mark.parametrize(("metrics", "field"), [
    ({"sources": []}, "metrics.sources"),
    ({"sources": ["prometheus", "prometheus"]}, "metrics.sources"),
    ({"sources": ["kafka"]}, "metrics.sources"),
    ({"preset": "ollama"}, "metrics.preset"),
    ({"gpu": "nvml"}, "metrics.gpu"),
    ({"queries": {"latency": "x"}}, "metrics.queries"),
    ({"queries": {"queue": " "}}, "metrics.queries"),
    ({"push": {"listen": "nowhere"}}, "metrics.push.listen"),
    ({"scrape": {"path": "metrics"}}, "metrics.scrape.path"),
])
def test_bad_metrics_settings_name_the_field(metrics, field):
    with pytest.raises(ConfigError) as info:
        cfg(**metrics)
    assert f": {field}" in str(info.value)


def test_pod_join_needs_pod_and_namespace_on_every_endpoint():
    with pytest.raises(ConfigError, match="needs 'pod' and 'namespace'"):
        config([service("llm", [version("v1", [{"address": "10.0.0.9:8000"}])])], metrics={"gpu_join": "pod"})


def test_drain_flag_reaches_the_engine():
    from xds_server.control import endpoint_specs

    c = config([service("llm", [version("v1", [{"address": "10.0.0.1:8000", "drain": True},
                                               {"address": "10.0.0.2:8000"}])])])
    assert [s.draining for s in endpoint_specs(c)] == [True, False]


def test_proto_api_compiles_at_import_and_round_trips():
    from protos import node_status_pb2, node_status_pb2_grpc

    msg = node_status_pb2.NodeStatus(instance="a:1", running=2, queue=0)
    back = node_status_pb2.NodeStatus.FromString(msg.SerializeToString())
    assert back.HasField("queue") and back.queue == 0 and not back.HasField("kv_cache_usage")
    assert node_status_pb2.DESCRIPTOR.package == "inferlb.v1"
    assert hasattr(node_status_pb2_grpc, "NodeStatusServiceStub")


@pytest.mark.parametrize(("requested", "installed", "expected"), [
    ("auto", True, "prometheus"), ("auto", False, "scrape"), ("scrape", True, "scrape"),
    ("prometheus", True, "prometheus")])
def test_demo_picks_its_metrics_source(requested, installed, expected):
    assert choose_metrics_source(requested, installed) == expected


def test_demo_refuses_prometheus_when_it_is_not_installed():
    with pytest.raises(stack.StackError, match="--metrics-source scrape"):
        choose_metrics_source("prometheus", False)


def test_demo_config_per_source():
    backends = [("v1", "a100", 9001), ("v1", "a10", 9002)]
    assert demo_config(backends, "scrape")["metrics"] == {"sources": ["scrape"]}
    assert demo_config(backends, "prometheus")["metrics"] == {"sources": ["prometheus"], "fallback": "scrape"}
