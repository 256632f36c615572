"""The Prometheus source against a real Prometheus (2.42): one pooled connection per parallel query,
so no "Connection pool is full" lines while Prometheus answers or while it is down (issue 15 item
9); the scrape interval read from Prometheus's own targets API (issue 15 item 11); DCGM's pod and
namespace labels renamed by Prometheus to exported_pod / exported_namespace still join, and an
endpoint no GPU series joins to is logged once with the query (issue 15 item 8); the time
Prometheus itself did not scrape an endpoint (a stall, a restart) does not make it stale; a restarted
control plane finds a down endpoint as old as its last good scrape."""

from __future__ import annotations

import http.server
import logging
import os
import signal
import threading
import time

import pytest
import yaml

from inferlb.devstack import stack
from tests.integration.conftest import wait_until
from xds_server.metrics.presets import VLLM_DCGM, preset, promql_queries
from xds_server.metrics.source import MetricsUnavailable
from xds_server.metrics.sources.prometheus import PrometheusSource

pytestmark = pytest.mark.integration

SCRAPE_S = 2.0


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    work = tmp_path_factory.mktemp("prom-source")
    sim_port, prom_port = stack.free_port(), stack.free_port()
    sim = stack.start_sim(sim_port, work, gpu_class="a100", version="v1")
    prom = stack.start_prometheus([f"127.0.0.1:{sim_port}"], work, prom_port, SCRAPE_S)
    yield f"http://127.0.0.1:{prom_port}", f"127.0.0.1:{sim_port}", prom
    for p in (prom, sim):
        p.stop()


def pool_full(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Connection pool is full" in r.getMessage()]


def test_parallel_queries_never_overflow_the_connection_pool(prometheus, caplog):
    url, instance, _ = prometheus
    assert len(VLLM_DCGM) > 10  # more parallel queries than urllib3's default pool of 10
    src = PrometheusSource(url, window_s=10, timeout_s=2)
    with caplog.at_level(logging.WARNING, logger="urllib3"):
        for _ in range(8):
            assert instance in src.fetch([instance])
    assert pool_full(caplog) == []


def test_the_scrape_interval_is_read_from_prometheus_targets(prometheus):
    url, instance, _ = prometheus
    src = PrometheusSource(url, window_s=10, timeout_s=2)
    assert src.sample_interval_s is None
    wait_until(lambda: src.fetch([instance]) and src.sample_interval_s, 20, 0.5, "the targets API to list the sim")
    assert src.sample_interval_s == SCRAPE_S
    assert src.describe() == {"scrape_interval_s": SCRAPE_S}
    other = PrometheusSource(url, window_s=10, timeout_s=2)
    other.fetch(["127.0.0.1:1"])  # not a target of this Prometheus: nothing learned
    assert other.sample_interval_s is None


def test_no_pool_overflow_while_prometheus_hangs(prometheus, caplog):
    """SIGSTOP: connections are accepted but never answered; every query times out, round after round."""
    url, instance, prom = prometheus
    src = PrometheusSource(url, window_s=10, timeout_s=0.5)
    src.fetch([instance])  # connections open and pooled
    os.kill(prom.popen.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="urllib3"):
            for _ in range(4):
                with pytest.raises(MetricsUnavailable):
                    src.fetch([instance])
            os.kill(prom.popen.pid, signal.SIGCONT)
            wait_until(lambda: _answers(src, instance), 10, 0.2, "Prometheus to answer again")
    finally:
        os.kill(prom.popen.pid, signal.SIGCONT)
    assert pool_full(caplog) == []


def _answers(src: PrometheusSource, instance: str) -> bool:
    try:
        return bool(src.fetch([instance]))
    except MetricsUnavailable:
        return False


#: What dcgm-exporter writes with its Kubernetes pod mapping: the GPU's workload as pod/namespace.
DCGM_PAGE = ("# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
             'DCGM_FI_DEV_GPU_UTIL{gpu="0",pod="llm-0",namespace="ai"} 40\n'
             'DCGM_FI_DEV_GPU_UTIL{gpu="1",pod="llm-1",namespace="ai"} 90\n'
             "# TYPE DCGM_FI_DEV_FB_FREE gauge\n"
             'DCGM_FI_DEV_FB_FREE{gpu="0",pod="llm-0",namespace="ai"} 30000\n'
             'DCGM_FI_DEV_FB_FREE{gpu="1",pod="llm-1",namespace="ai"} 1000\n')


class _MetricsPage(http.server.BaseHTTPRequestHandler):
    """Serves ``page()`` as a Prometheus text exposition, quietly."""

    def page(self) -> bytes:
        raise NotImplementedError

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.page()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Exporter(_MetricsPage):
    def page(self) -> bytes:
        return DCGM_PAGE.encode()


@pytest.fixture(scope="module")
def kubernetes_prometheus(tmp_path_factory):
    """Prometheus scraping a sim and a dcgm-exporter stand-in whose target carries pod/namespace
    labels of its own (as Kubernetes service discovery gives it): Prometheus renames the exporter's
    pod/namespace to exported_pod / exported_namespace (honor_labels: false, its default)."""
    work = tmp_path_factory.mktemp("prom-k8s")
    sim_port, prom_port = stack.free_port(), stack.free_port()
    sim = stack.start_sim(sim_port, work, gpu_class="a100", version="v1")
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "inference", "static_configs": [{"targets": [f"127.0.0.1:{sim_port}"]}]},
            {"job_name": "dcgm", "static_configs": [{"targets": [f"127.0.0.1:{exporter.server_port}"],
                                                     "labels": {"pod": "dcgm-exporter-x",
                                                                "namespace": "gpu-operator"}}]}]}))
    prom = stack.spawn("prometheus-k8s", [stack.prometheus_binary(), f"--config.file={work / 'prometheus.yml'}",
                                          f"--storage.tsdb.path={work / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], work)
    stack.wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom)
    yield f"http://127.0.0.1:{prom_port}", f"127.0.0.1:{sim_port}"
    prom.stop()
    exporter.shutdown()
    sim.stop()


def pod_source(url: str, instance: str, pod: str) -> PrometheusSource:
    specs = preset("vllm", "dcgm")
    return PrometheusSource(url, window_s=10, timeout_s=2, queries=promql_queries(specs, ("namespace", "pod")),
                            gpu_keys={instance: f"ai/{pod}"}, gpu_fields=[f for f, s in specs.items() if s.gpu])


def test_dcgm_labels_renamed_to_exported_pod_and_namespace_still_join(kubernetes_prometheus, caplog):
    url, instance = kubernetes_prometheus
    src = pod_source(url, instance, "llm-0")
    caplog.set_level(logging.WARNING, logger="xds_server.metrics.sources.prometheus")
    # Both scraped: the GPU series, and the endpoint's own series (Prometheus may scrape the exporter
    # first; until the endpoint's own series answer, a missing GPU join is not warned about).
    got = wait_until(lambda: (st := src.fetch([instance])[instance]).gpu_util is not None
                     and st.running is not None and st, 20, 0.5, "the own and GPU series of pod ai/llm-0")
    assert got.gpu_util == pytest.approx(0.40) and got.gpu_mem_free_mib == 30000
    raw = src._prom.custom_query('DCGM_FI_DEV_GPU_UTIL{exported_pod="llm-0"}')  # Prometheus did rename it
    assert raw and raw[0]["metric"]["pod"] == "dcgm-exporter-x"

    missing = pod_source(url, instance, "llm-9")
    with caplog.at_level(logging.WARNING, logger="xds_server.metrics.sources.prometheus"):
        for _ in range(6):
            assert missing.fetch([instance])[instance].gpu_util is None
    warned = [m for r in caplog.records if "match no series" in (m := r.getMessage()) and "llm-9" in m]
    assert len(warned) == 1 and instance in warned[0] and "'ai/llm-9'" in warned[0]
    assert "DCGM_FI_DEV_GPU_UTIL" in warned[0]


class _Backend(_MetricsPage):
    """A vLLM-like /metrics page whose answer can be delayed (``server.delay_s``) or refused
    (``server.down``: 503, so Prometheus's scrape fails and writes ``up`` 0)."""

    def page(self) -> bytes:
        return b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 1\n'

    def do_GET(self):  # noqa: N802 (http.server's name)
        time.sleep(self.server.delay_s)  # type: ignore[attr-defined]
        if self.server.down:  # type: ignore[attr-defined]
            self.send_error(503)
            return
        super().do_GET()


@pytest.fixture()
def paused_prometheus(tmp_path):
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    backend.delay_s, backend.down = 0.0, False  # type: ignore[attr-defined]
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    instance, prom_port = f"127.0.0.1:{backend.server_port}", stack.free_port()
    prom = stack.start_prometheus([instance], tmp_path, prom_port, 1.0)
    src = PrometheusSource(f"http://127.0.0.1:{prom_port}", window_s=10, timeout_s=2)
    wait_until(lambda: src.fetch([instance])[instance].sample_age_s < 1.5 and src.sample_interval_s, 20, 0.2,
               "a first scrape and the scrape interval")
    yield src, instance, backend, prom
    os.kill(prom.popen.pid, signal.SIGCONT)
    prom.stop()
    backend.shutdown()


def test_a_prometheus_stall_does_not_age_the_endpoints(paused_prometheus, caplog):
    """Prometheus stopped 4 s (scrape every 1 s), then resumed: until it scrapes the endpoint again
    (held 0.8 s by a slow answer), the newest sample is 4 s old, but only one scrape interval of that
    counts; Prometheus's lag is logged once."""
    src, instance, backend, prom = paused_prometheus
    assert src.sample_interval_s == 1.0
    backend.delay_s = 0.8
    os.kill(prom.popen.pid, signal.SIGSTOP)
    time.sleep(4.0)
    os.kill(prom.popen.pid, signal.SIGCONT)
    with caplog.at_level(logging.WARNING, logger="xds_server.metrics.sources.prometheus"):
        age = src.fetch([instance])[instance].sample_age_s
    wall_age = time.time() - src._last_seen[instance]
    assert wall_age >= 3.5, "the sample should be from before the stall"
    assert age <= 1.5, (age, wall_age)
    assert [r for r in caplog.records if "has not scraped 1 of 1 endpoints" in r.getMessage()]
    backend.delay_s = 0.0
    wait_until(lambda: src.fetch([instance])[instance].sample_age_s < 1.5, 10, 0.2, "fresh samples again")


def test_an_endpoint_prometheus_cannot_scrape_ages_by_the_wall_clock(paused_prometheus):
    """Prometheus keeps scraping (``up`` 0 each time) an endpoint that answers 503: its age grows."""
    src, instance, backend, _ = paused_prometheus
    backend.down = True
    started = time.time()
    time.sleep(3.5)
    age = src.fetch([instance])[instance].sample_age_s
    assert age >= time.time() - started - 1.0, age


def test_a_restarted_control_plane_finds_a_down_endpoint_as_old_as_its_last_good_scrape(paused_prometheus):
    """The endpoint answers 503 (Prometheus scrapes it, ``up`` 0, and marks its series stale); then a
    fresh source, as a restarted control plane builds it: its first fetch is at least as old as the
    time the endpoint has been down, not 0 (it would stay HEALTHY for another stale_after_s); with a
    short threshold, the range (2 x stale_after_s) is all failed scrapes and the age is over it."""
    src, instance, backend, _ = paused_prometheus
    backend.down = True
    started = time.time()
    wait_until(lambda: not src._prom.custom_query(f'vllm:num_requests_running{{instance="{instance}"}}'), 10, 0.2,
               "Prometheus to mark the endpoint's series stale")
    time.sleep(max(0.0, 4.0 - (time.time() - started)))
    down_for = time.time() - started
    restarted = PrometheusSource(src._url, window_s=10, timeout_s=2)
    assert restarted.fetch([instance])[instance].sample_age_s >= down_for
    short = PrometheusSource(src._url, window_s=10, timeout_s=2, stale_after_s=1.5)  # range 3 s: all failed
    assert short.fetch([instance])[instance].sample_age_s > 1.5
    assert PrometheusSource(src._url, window_s=10, timeout_s=2).fetch(["127.0.0.1:1"])["127.0.0.1:1"].sample_age_s == 0
