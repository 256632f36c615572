"""The Prometheus source against a real Prometheus (2.42): one pooled connection per parallel query,
so no "Connection pool is full" lines while Prometheus answers or while it is down (issue 15 item
9); the scrape interval read from Prometheus's own targets API (issue 15 item 11)."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from inferlb.devstack import stack
from tests.integration.conftest import wait_until
from xds_server.metrics.presets import VLLM_DCGM
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
