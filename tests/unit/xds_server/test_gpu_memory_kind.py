"""How an endpoint's GPU memory behaves (preallocated KV-cache pool or per request): where the config
decides it, and what the slow loop reads as its memory headroom."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.factories import cluster_round, config, score, service, spec, stats, version
from xds_server.config import ConfigError
from xds_server.control import endpoint_specs
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EngineParams, EngineState

#: An llm engine on an A100 as DCGM shows it: vLLM took 0.9 of the GPU at start (81 920 MiB x 0.9).
VLLM_USED_MIB = 73728.0
FREE_MIB = 81920.0 - VLLM_USED_MIB
OK = {"gpu_util": 0.3, "running": 1.0, "queue": 0.0, "latency_mean_ms": 50.0, "latency_p95_ms": 80.0}


def two_versions(v1: dict | None = None, v2: dict | None = None, **sections: object):
    return config([service("llm", [{**version("v1", 1), **(v1 or {})}, {**version("v2", 1), **(v2 or {})}])],
                  **sections)


def preallocated(cfg) -> dict[str, bool]:
    return {s.cluster: s.preallocated for s in endpoint_specs(cfg)}


@pytest.mark.parametrize(("preset", "expected"), [("vllm", True), ("sglang", True), ("tgi", True), ("triton", False)])
def test_the_engine_preset_decides_by_default(preset, expected):
    assert preallocated(two_versions(metrics={"preset": preset})) == {"llm-v1": expected, "llm-v2": expected}


def test_a_version_may_say_otherwise_either_way():
    cfg = two_versions({"gpu_memory": "per_request"})
    assert preallocated(cfg) == {"llm-v1": False, "llm-v2": True}
    cfg = two_versions(v2={"gpu_memory": "preallocated"}, metrics={"preset": "triton"})
    assert preallocated(cfg) == {"llm-v1": False, "llm-v2": True}


def test_an_unknown_kind_names_the_field():
    with pytest.raises(ConfigError, match=r"services\[0\]\.versions\[0\]\.gpu_memory"):
        two_versions({"gpu_memory": "static"})


class Rounds:
    """The engine round after round on one clock (health and weight changes take effect at once)."""

    def __init__(self, endpoints):
        self.eps, self.state, self.now = endpoints, EngineState(), 0.0
        self.params = EngineParams(hysteresis=0.0, max_change=None, health_rounds=1)

    def run(self, seen):
        self.now += 1.0
        weights, self.state = compute_weights(self.eps, seen, self.state, self.params, now=self.now, plugins=BUILTIN)
        return {w.address: w for w in weights}


def test_a_kv_pool_engine_at_90_percent_gpu_memory_used_is_not_short_of_memory():
    """The same samples (90 % of the GPU used: 8 192 MiB free; KV cache 20 % used) and a request need
    of 10 000 MiB: a per-request server is short of memory and derated after 3 rounds; an engine with
    a KV-cache pool is not."""
    pool, job = spec(0, "c", memory_mib=81920.0), spec(1, "c", memory_mib=81920.0)
    pool = replace(pool, preallocated=True)
    r = Rounds([pool, job])
    r.params = replace(r.params, request_memory_mib=10000.0)
    seen = {e.instance: stats(**OK, gpu_mem_used_mib=VLLM_USED_MIB, kv_cache=0.2) for e in (pool, job)}
    for _ in range(3):
        out = r.run(seen)
    assert out[pool.address].factors["gpu_memory"] == 1.0
    assert out[job.address].factors["gpu_memory"] == 0.5


@pytest.mark.parametrize(("kv", "derated"), [(0.85, False), (0.9, True), (0.97, True)])
def test_a_kv_pool_engine_is_short_when_its_kv_cache_stays_at_kv_full(kv, derated):
    pool = replace(spec(0, "c"), preallocated=True)
    r = Rounds([pool, replace(spec(1, "c"), preallocated=True)])
    seen = {pool.instance: stats(**OK, gpu_mem_free_mib=FREE_MIB, kv_cache=kv),
            spec(1, "c").instance: stats(**OK, gpu_mem_free_mib=FREE_MIB, kv_cache=0.1)}
    factors = [r.run(seen)[pool.address].factors["gpu_memory"] for _ in range(3)]
    assert factors == [1.0, 1.0, 0.5 if derated else 1.0]
    seen[pool.instance] = stats(**OK, gpu_mem_free_mib=FREE_MIB)  # no KV-cache data: no change
    assert r.run(seen)[pool.address].factors["gpu_memory"] == (0.5 if derated else 1.0)


def test_kv_full_is_a_parameter_of_the_gpu_memory_factor():
    factor = BUILTIN.factors["gpu_memory"]
    pool = replace(spec(0, "c"), preallocated=True)
    rnd = cluster_round([(pool, stats(kv_cache=0.8))])
    for kv_full, derated in ((0.75, True), (0.9, False)):
        p = factor.params(rounds=1, kv_full=kv_full)
        multipliers, _ = factor.run(rnd, p, {}, rnd.columns.capacity)
        assert multipliers.tolist() == [0.5 if derated else 1.0]


def test_the_memory_score_of_a_kv_pool_engine_is_its_free_kv_share():
    pool = replace(spec(0, "c"), preallocated=True)
    assert score("memory", pool, stats(gpu_mem_free_mib=FREE_MIB, kv_cache=0.25)) == pytest.approx(0.75)
    assert score("memory", pool, stats(gpu_mem_free_mib=FREE_MIB)) is None
    # a per-request server: (free - need) / (total - need), need = 2 048 MiB x 1.2
    need = 2048.0 * 1.2
    assert score("memory", spec(0, "c"), stats(gpu_mem_free_mib=FREE_MIB, kv_cache=0.25)) == pytest.approx(
        (FREE_MIB - need) / (81920.0 - need))
