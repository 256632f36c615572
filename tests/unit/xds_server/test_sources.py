"""The scrape source (own windows over the simulator's real exposition), merging sources by freshness,
the combined source's failure and fallback rules (C05), and the push source over real gRPC."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from inferlb.devstack.stack import free_port
from protos import node_status_pb2, node_status_pb2_grpc
from sim.config import BackendConfig
from sim.metrics import GaugeSnapshot, SimMetrics
from sim.node import SimNode
from sim.push import push_status
from xds_server.metrics.combined import CombinedSource
from xds_server.metrics.merge import merge
from xds_server.metrics.presets import preset
from xds_server.metrics.source import MetricsUnavailable
from xds_server.metrics.sources.push import BadStatus, PushSource, start_push_server, to_stats
from xds_server.metrics.sources.scrape import ScrapeSource, parse_exposition, sample_names
from xds_server.metrics.stats import EndpointStats

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def sim_metrics(legacy: bool = False) -> SimMetrics:
    return SimMetrics(model_name="m", gpu_model_name="NVIDIA A100", gpu_uuid="GPU-1", hostname="h",
                      legacy_kv_name=legacy)


def page(m: SimMetrics, running=2, waiting=1, kv=0.25, util=25.0, used=20000.0, free=61920.0) -> str:
    return m.render(GaugeSnapshot(running, waiting, kv, util, used, free)).decode()


# --- scrape source ---------------------------------------------------------------------------------


def test_scrape_source_computes_the_preset_over_its_window():
    m = sim_metrics()
    src = ScrapeSource({A: f"http://{A}/metrics"}, preset("vllm", "dcgm"), window_s=10)
    for t, lat in ((100.0, 0.1), (101.0, 0.3), (102.0, 0.2)):
        m.observe_ttft(0.01)
        m.observe_finished(e2e_s=lat, queue_s=0.0, prompt_tokens=1, generation_tokens=1)
        m.observe_http("/v1/chat/completions", 200)
        src.ingest(A, page(m, running=int(t) - 98), t)
    m.observe_http("/v1/chat/completions", 500)
    m.observe_oom()
    src.ingest(A, page(m, running=5), 103.0)
    st = src.fetch([A], now=103.5)[A]
    assert st.sample_age_s == pytest.approx(0.5)
    assert st.running == pytest.approx((2 + 3 + 4 + 5) / 4)  # avg_over_time
    assert st.in_flight == 5 + 1  # newest running + waiting
    assert st.queue == 1.0 and st.kv_cache == 0.25
    assert st.gpu_util == pytest.approx(0.25)  # DCGM percent -> 0..1
    assert (st.gpu_mem_free_mib, st.gpu_mem_used_mib) == (61920.0, 20000.0)
    assert st.latency_mean_ms == pytest.approx((0.3 + 0.2) / 2 * 1000)  # increase over the window
    assert 200 <= st.latency_p95_ms <= 300
    assert st.request_rate == pytest.approx(2 / 3)
    assert st.error_rate == pytest.approx(1 / 3)  # one 5xx of three responses in the window
    assert (st.success_total, st.oom_total) == (3.0, 1.0)


def test_scrape_source_reads_the_legacy_kv_cache_name():
    """C09 without Prometheus."""
    src = ScrapeSource({A: "x", B: "y"}, preset(), window_s=10)
    src.ingest(A, page(sim_metrics(legacy=False), kv=0.5), 1.0)
    src.ingest(B, page(sim_metrics(legacy=True), kv=0.7), 1.0)
    got = src.fetch([A, B], now=1.0)
    assert got[A].kv_cache == 0.5 and got[B].kv_cache == 0.7


def test_scrape_window_forgets_old_samples_and_ages():
    src = ScrapeSource({A: "x"}, preset(), window_s=5, interval_s=1)
    m = sim_metrics()
    src.ingest(A, page(m, running=8), 100.0)
    src.ingest(A, page(m, running=0), 106.0)
    st = src.fetch([A], now=106.0)[A]
    assert st.running == 0.0  # the sample at 100 s is out of the 5 s window
    assert src.fetch([A], now=130.0)[A].sample_age_s == pytest.approx(24.0)
    assert src.fetch([A], now=130.0)[A].running is None  # nothing left in the window: no data, not 0


def test_never_scraped_ages_from_first_asked():
    src = ScrapeSource({A: "x"}, preset(), window_s=5)
    assert src.fetch([A], now=10.0)[A] == EndpointStats(sample_age_s=0.0)
    assert src.fetch([A], now=26.0)[A].sample_age_s == pytest.approx(16.0)


@pytest.mark.parametrize("garbage", ["<html>502 Bad Gateway</html>", "vllm:num_requests_running{ 1",
                                     "vllm:num_requests_running abc"])
def test_a_garbage_page_is_refused_and_adds_nothing(garbage):
    src = ScrapeSource({A: "x"}, preset(), window_s=5)
    src.ingest(A, page(sim_metrics()), 1.0)
    with pytest.raises(ValueError):
        src.ingest(A, garbage, 2.0)
    assert src.fetch([A], now=2.0)[A].sample_age_s == pytest.approx(1.0)


def test_only_the_samples_the_preset_reads_are_kept():
    keep = sample_names(preset())
    assert "vllm:e2e_request_latency_seconds_bucket" in keep and "DCGM_FI_DEV_FB_FREE" in keep
    parsed = parse_exposition(page(sim_metrics()), keep)
    assert "vllm:time_to_first_token_seconds_bucket" not in parsed
    assert set(parsed) <= keep


def test_scrape_source_over_http_against_a_real_simulator(tmp_path):
    """The aiohttp loop: scrapes a live simulator, then notices when its /metrics breaks."""
    from sim.server import start_backend

    async def main():
        runner, port = await start_backend(BackendConfig(port=0))
        inst = f"127.0.0.1:{port}"
        src = ScrapeSource({inst: f"http://{inst}/metrics"}, preset(), window_s=5, interval_s=0.05, timeout_s=0.5)
        task = asyncio.create_task(src.run())
        try:
            await asyncio.sleep(0.3)
            st = src.fetch([inst])[inst]
            assert st.running == 0.0 and st.sample_age_s < 0.2 and st.gpu_mem_free_mib > 0
            from sim.server import get_node
            get_node(runner.app).faults.apply({"metrics": "error"})
            await asyncio.sleep(0.5)
            assert src.fetch([inst])[inst].sample_age_s >= 0.4
            assert src.describe()["failing_targets"] == {inst: "HTTP 503"}
        finally:
            task.cancel()
            await runner.cleanup()

    asyncio.run(main())


# --- merging by freshness -------------------------------------------------------------------------


def test_each_input_comes_from_the_freshest_source_that_has_it():
    prom = {A: EndpointStats(queue=5.0, latency_mean_ms=100.0, kv_cache=0.5, sample_age_s=3.0)}
    push = {A: EndpointStats(queue=1.0, kv_cache=0.1, sample_age_s=0.2)}
    merged, origin = merge({"prometheus": prom, "push": push}, [A], stale_after_s=15)
    st = merged[A]
    assert (st.queue, st.kv_cache, st.latency_mean_ms, st.sample_age_s) == (1.0, 0.1, 100.0, 0.2)
    assert origin[A] == {"queue": "push", "kv_cache": "push", "latency_mean_ms": "prometheus",
                         "sample_age_s": "push"}


def test_a_stale_source_does_not_mix_in_when_a_fresh_one_exists():
    prom = {A: EndpointStats(queue=0.0, latency_mean_ms=100.0, sample_age_s=40.0)}
    push = {A: EndpointStats(queue=3.0, sample_age_s=0.5)}
    st = merge({"prometheus": prom, "push": push}, [A], stale_after_s=15)[0][A]
    assert st.latency_mean_ms is None and st.queue == 3.0


def test_staleness_applies_to_pushed_status_too():
    prom = {A: EndpointStats(queue=2.0, sample_age_s=1.0)}
    push = {A: EndpointStats(queue=0.0, sample_age_s=20.0)}  # the node stopped pushing
    st = merge({"prometheus": prom, "push": push}, [A], stale_after_s=15)[0][A]
    assert st.queue == 2.0 and st.sample_age_s == 1.0


def test_all_stale_keeps_the_freshest_values_and_its_age():
    prom = {A: EndpointStats(queue=2.0, sample_age_s=30.0)}
    push = {A: EndpointStats(queue=1.0, running=1.0, sample_age_s=20.0)}
    st = merge({"prometheus": prom, "push": push}, [A, B], stale_after_s=15)[0]
    assert st[A].queue == 1.0 and st[A].sample_age_s == 20.0
    assert st[B] == EndpointStats()  # never seen by anyone


def test_one_source_gives_each_instance_the_inputs_it_has():
    prom = {A: EndpointStats(queue=2.0, running=1.0, sample_age_s=1.0)}
    merged, origin = merge({"prometheus": prom}, [A, B], stale_after_s=15)
    assert merged[A] is prom[A] and merged[B] == EndpointStats()
    assert dict(origin) == {A: {"queue": "prometheus", "running": "prometheus", "sample_age_s": "prometheus"}, B: {}}
    assert origin.sources() == {"prometheus"}
    assert merge({"prometheus": {}}, [B], stale_after_s=15)[1].sources() == set()


def test_ties_go_to_the_earlier_source():
    a = {A: EndpointStats(queue=1.0, sample_age_s=1.0)}
    b = {A: EndpointStats(queue=2.0, sample_age_s=1.0)}
    assert merge({"a": a, "b": b}, [A], 15)[0][A].queue == 1.0


# --- the combined source: failure, fallback, name ---------------------------------------------------


class Fake:
    def __init__(self, name, stats=None, fail=None):
        self.name, self.stats, self.fail, self.calls = name, stats or {}, fail, 0

    def fetch(self, instances):
        self.calls += 1
        if self.fail:
            raise MetricsUnavailable(self.fail)
        return {i: s for i, s in self.stats.items() if i in instances}


def test_a_failed_source_without_fallback_fails_the_round():
    """C05: the control plane then keeps the last good weights; push data alone does not rescue it."""
    push = Fake("push", {A: EndpointStats(queue=0.0, sample_age_s=0.1)})
    src = CombinedSource([Fake("prometheus", fail="timed out")], push=push)
    with pytest.raises(MetricsUnavailable, match="prometheus: timed out"):
        src.fetch([A])
    assert src.describe()["sources"]["prometheus"] == {"failures": 1, "last_error": "timed out"}


def test_the_fallback_answers_for_a_failed_source_and_the_name_says_so():
    prom = Fake("prometheus", {A: EndpointStats(queue=1.0, sample_age_s=1.0)})
    scrape = Fake("scrape", {A: EndpointStats(queue=4.0, sample_age_s=0.5)})
    src = CombinedSource([prom], fallback=scrape)
    assert src.fetch([A])[A].queue == 1.0 and src.name == "prometheus"
    assert scrape.calls == 0  # not asked while Prometheus answers
    prom.fail = "HTTP 503"
    assert src.fetch([A])[A].queue == 4.0
    assert src.name == "scrape" and src.fallback_active
    assert src.describe()["fallback_active"] is True
    prom.fail = None
    src.fetch([A])
    assert src.name == "prometheus" and not src.fallback_active


def test_name_lists_the_sources_that_gave_something():
    prom = Fake("prometheus", {A: EndpointStats(latency_mean_ms=5.0, sample_age_s=2.0)})
    push = Fake("push", {A: EndpointStats(queue=0.0, sample_age_s=0.1)})
    src = CombinedSource([prom], push=push)
    src.fetch([A])
    assert src.name == "prometheus+push"
    assert src.origin[A]["queue"] == "push" and src.origin[A]["latency_mean_ms"] == "prometheus"


# --- push source ----------------------------------------------------------------------------------


def test_node_status_to_stats():
    st = to_stats(node_status_pb2.NodeStatus(instance=A, running=2, queue=1, gpu_memory_free_mib=100,
                                             kv_cache_usage=0.5, gpu_utilization=0.75))
    assert (st.running, st.queue, st.in_flight, st.gpu_mem_free_mib, st.kv_cache, st.gpu_util) == (
        2, 1, 3, 100, 0.5, 0.75)
    partial = to_stats(node_status_pb2.NodeStatus(instance=A, queue=4))
    assert partial.queue == 4 and partial.running is None and partial.in_flight is None


@pytest.mark.parametrize("bad", [{"queue": -1.0}, {"running": math.nan}, {"kv_cache_usage": 1.5},
                                 {"gpu_memory_free_mib": math.inf}])
def test_bad_node_status_is_refused(bad):
    with pytest.raises(BadStatus):
        to_stats(node_status_pb2.NodeStatus(instance=A, **bad))


def test_push_source_keeps_the_newest_per_known_instance_and_ages_it():
    src = PushSource([A])
    src.record(node_status_pb2.NodeStatus(instance=A, queue=1), at=100.0)
    src.record(node_status_pb2.NodeStatus(instance=A, queue=3), at=101.0)
    with pytest.raises(BadStatus, match="unknown instance"):
        src.record(node_status_pb2.NodeStatus(instance=B, queue=1), at=101.0)
    got = src.fetch([A, B], now=104.0)
    assert set(got) == {A} and got[A].queue == 3 and got[A].sample_age_s == pytest.approx(3.0)


def test_a_simulator_started_with_push_status_pushes_as_its_bound_address():
    from sim.server import start_backend

    async def main():
        sim_port = free_port()
        src = PushSource([f"127.0.0.1:{sim_port}"])
        server, port = await start_push_server(src, "127.0.0.1:0")
        runner, _ = await start_backend(BackendConfig(port=sim_port, push_status=f"127.0.0.1:{port}",
                                                      push_interval_s=0.02))
        try:
            for _ in range(100):
                await asyncio.sleep(0.02)
                if src.fetch([f"127.0.0.1:{sim_port}"]):
                    break
            assert src.fetch([f"127.0.0.1:{sim_port}"])[f"127.0.0.1:{sim_port}"].running == 0
        finally:
            await runner.cleanup()
            await server.stop(0)

    asyncio.run(main())


def test_push_over_grpc_from_the_simulator():
    """The simulator's pusher -> our gRPC server -> the source; a bad message is refused, not fatal."""

    async def main():
        src = PushSource(["sim-a"])
        server, port = await start_push_server(src, "127.0.0.1:0")
        node = SimNode(BackendConfig(port=0))
        task = asyncio.create_task(push_status(node, f"127.0.0.1:{port}", 0.02, "sim-a"))
        try:
            for _ in range(100):
                await asyncio.sleep(0.02)
                if "sim-a" in src.fetch(["sim-a"]):
                    break
            st = src.fetch(["sim-a"])["sim-a"]
            assert st.running == 0 and st.queue == 0 and st.kv_cache == 0.0 and st.gpu_mem_free_mib > 0
            assert st.sample_age_s < 0.5
            node.faults.apply({"push": "stop"})
            await asyncio.sleep(0.3)
            assert src.fetch(["sim-a"])["sim-a"].sample_age_s >= 0.2
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = node_status_pb2_grpc.NodeStatusServiceStub(ch)

                async def msgs():
                    yield node_status_pb2.NodeStatus(instance="nobody", queue=1)
                    yield node_status_pb2.NodeStatus(instance="sim-a", queue=7)

                summary = await stub.Push(msgs())
            assert (summary.accepted, summary.rejected) == (1, 1) and "unknown instance" in summary.last_error
            assert src.fetch(["sim-a"])["sim-a"].queue == 7
        finally:
            node.faults.close()
            task.cancel()
            await server.stop(0)

    asyncio.run(main())


# --- staleness fitted to the sources' own sample intervals (issue 15 item 11) ----------------------


async def test_a_learned_scrape_interval_longer_than_half_the_staleness_raises_it_once(caplog):
    """Prometheus scrapes every 20 s, engine.stale_after_s is 15: sample ages cycle 0-20 s, so an
    endpoint would flap. The control plane uses 2 x 20 s instead, says so once, and keeps the
    endpoint whose last sample is 18 s old HEALTHY."""
    import logging
    from types import SimpleNamespace

    from tests.support.factories import config, service, version
    from xds_server.ads.server import SnapshotCache
    from xds_server.control import ControlPlane

    cfg = config([service("chat", [version("v1", [{"address": A}, {"address": B}])])],
                 engine={"stale_after_s": 15})
    ages = {A: 2.0, B: 18.0}
    prom = SimpleNamespace(name="prometheus", sample_interval_s=None,
                           fetch=lambda instances: {i: EndpointStats(sample_age_s=ages[i]) for i in instances})
    cp = ControlPlane(cfg, CombinedSource([prom]), SnapshotCache(), [], lambda: "127.0.0.1:1")
    await cp.run_round()
    assert cp.stale_after_s == 15 and {w.address: w.health for w in cp.weights}[B] == "UNHEALTHY"
    prom.sample_interval_s = 20.0  # learned from /api/v1/targets
    with caplog.at_level(logging.WARNING, logger="xds_server.control"):
        for _ in range(3):
            await cp.run_round()
    assert cp.stale_after_s == 40 and cp.source.stale_after_s == 40
    assert {w.health for w in cp.weights} == {"HEALTHY"}
    warned = [r.getMessage() for r in caplog.records if "stale_after_s" in r.getMessage()]
    assert len(warned) == 1 and "prometheus's sample interval (20 s)" in warned[0] and "using 40 s" in warned[0]


# --- GPU inputs from a separate exporter, Kubernetes label renames (issue 15 item 8) ---------------

OWN_PAGE = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 2\n"
DCGM_PAGE = (  # a node's dcgm-exporter as Prometheus would have renamed its labels on Kubernetes
    "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",exported_pod="llm-0",exported_namespace="ai",pod="dcgm-x",'
    'namespace="gpu-operator"} 40\n'
    'DCGM_FI_DEV_GPU_UTIL{gpu="1",exported_pod="llm-1",exported_namespace="ai",pod="dcgm-x",'
    'namespace="gpu-operator"} 90\n')


async def test_the_scrape_source_reads_gpu_inputs_from_a_configured_exporter_with_exported_labels(caplog):
    import logging

    from aiohttp import web

    async def own(_):
        return web.Response(text=OWN_PAGE)

    async def dcgm(_):
        return web.Response(text=DCGM_PAGE)

    app = web.Application()
    app.router.add_get("/metrics", own)
    app.router.add_get("/dcgm", dcgm)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    pods = {A: {"namespace": "ai", "pod": "llm-0"}, B: {"namespace": "ai", "pod": "llm-9"}}
    src = ScrapeSource({A: f"{base}/metrics", B: f"{base}/metrics"}, preset("vllm", "dcgm"), 10.0, 0.05, 1.0,
                       pods, {A: f"{base}/dcgm", B: f"{base}/dcgm"})
    task = asyncio.create_task(src.run())
    try:
        with caplog.at_level(logging.WARNING, logger="xds_server.metrics.sources.scrape"):
            for _ in range(100):
                await asyncio.sleep(0.05)
                got = src.fetch([A, B])
                if got[A].gpu_util is not None:
                    break
            for _ in range(3):
                got = src.fetch([A, B])
    finally:
        task.cancel()
        await runner.cleanup()
    assert got[A].gpu_util == pytest.approx(0.40) and got[A].running == 2  # its pod's GPU, not llm-1's
    assert got[B].gpu_util is None and got[B].running == 2
    warned = [r.getMessage() for r in caplog.records if "match no series" in r.getMessage()]
    assert len(warned) == 1 and B in warned[0] and f"{base}/dcgm" in warned[0] and "llm-9" in warned[0]
