"""Pure simulation model: latency table, GPU classes, memory, sessions, utilisation."""

import random

import pytest

from sim.config import BackendConfig
from sim.model import (
    GPU_CLASSES,
    MemoryPool,
    SessionCache,
    base_latency_ms,
    draw_long_tail,
    gpu_util_percent,
    plan_latency,
    request_memory_mib,
)

A100, A10, H100 = GPU_CLASSES["a100"], GPU_CLASSES["a10"], GPU_CLASSES["h100"]


@pytest.mark.parametrize(
    ("in_flight", "ms"),
    [(0, 50.0), (1, 50.0), (2, 95.0), (3, 157.5), (4, 220.0), (5, 282.5), (8, 470.0)],
)
def test_base_latency_table_interpolates_and_extrapolates(in_flight, ms):
    assert base_latency_ms(in_flight) == pytest.approx(ms)


@pytest.mark.parametrize(("in_flight", "ms"), [(1, 50.0), (2, 95.0), (4, 220.0)])
def test_warm_session_latency_matches_field_figures_per_class(in_flight, ms):
    a100 = plan_latency(in_flight, A100, session_hit=True)
    a10 = plan_latency(in_flight, A10, session_hit=True)
    h100 = plan_latency(in_flight, H100, session_hit=True)
    assert a100.service_ms == pytest.approx(ms)
    assert a10.service_ms == pytest.approx(2.5 * ms)
    assert h100.service_ms == pytest.approx(0.6 * ms)


def test_new_session_pays_prefill_penalty_scaled_by_class_and_time():
    warm = plan_latency(1, A10, session_hit=True, time_scale=0.5)
    cold = plan_latency(1, A10, session_hit=False, time_scale=0.5, prefill_penalty_ms=40.0)
    assert cold.service_ms - warm.service_ms == pytest.approx(40.0 * 2.5 * 0.5)
    assert cold.prefill_ms - warm.prefill_ms == pytest.approx(40.0 * 2.5 * 0.5)
    assert warm.prefill_ms == pytest.approx(0.3 * warm.service_ms)


def test_long_tail_slow_factor_and_time_scale_multiply():
    plan = plan_latency(2, A100, session_hit=True, long_tail=True, slow_factor=3.0, time_scale=0.1)
    assert plan.service_ms == pytest.approx(95.0 * 10 * 3.0 * 0.1)
    assert plan.long_tail


def test_long_tail_draw_is_seeded_and_matches_probability():
    a = [draw_long_tail(random.Random(7), 0.5) for _ in range(3)]
    rng1, rng2 = random.Random(42), random.Random(42)
    assert [draw_long_tail(rng1, 0.3) for _ in range(50)] == [draw_long_tail(rng2, 0.3) for _ in range(50)]
    assert a[0] == a[1] == a[2]
    rng = random.Random(1)
    share = sum(draw_long_tail(rng, 0.2) for _ in range(5000)) / 5000
    assert 0.17 < share < 0.23
    assert not any(draw_long_tail(rng, 0.0) for _ in range(100))


def test_gpu_class_memory():
    assert (A100.memory_mib, A10.memory_mib, H100.memory_mib) == (81920, 24576, 81920)
    assert A10.dcgm_model_name == "NVIDIA A10"


def test_memory_pool_admits_up_to_the_limit_and_no_further():
    pool = MemoryPool(total_mib=24576, weights_mib=14336)
    assert pool.kv_capacity_mib == 10240
    assert pool.try_reserve(8192)
    assert not pool.try_reserve(2049)  # would exceed total by 1 MiB
    assert pool.held_mib == 8192  # a refused request changes nothing
    assert pool.try_reserve(2048)  # exactly at the limit
    assert pool.free_mib == 0 and pool.kv_usage == 1.0
    assert not pool.try_reserve(0.5)
    pool.release(8192)
    pool.release(2048)
    assert pool.held_mib == 0 and pool.used_mib == 14336 and pool.kv_usage == 0.0


def test_memory_pool_kv_usage_is_fraction_of_non_weight_memory():
    pool = MemoryPool(total_mib=81920, weights_mib=14336)
    pool.try_reserve(67584 / 4)
    assert pool.kv_usage == pytest.approx(0.25)
    assert pool.used_mib + pool.free_mib == pytest.approx(81920)


def test_eighteen_gib_request_fits_a100_but_not_a10():
    a10 = MemoryPool(GPU_CLASSES["a10"].memory_mib, 14336)
    a100 = MemoryPool(GPU_CLASSES["a100"].memory_mib, 14336)
    assert not a10.try_reserve(18432)
    assert a100.try_reserve(18432)


def test_request_memory_from_tokens_or_header():
    assert request_memory_mib(128, 0.5) == 64.0
    assert request_memory_mib(128, 0.5, explicit_mib=8192) == 8192.0


def test_session_cache_lru_hits_and_evicts_oldest():
    cache = SessionCache(capacity=2)
    assert cache.touch("a") is False
    assert cache.touch("b") is False
    assert cache.touch("a") is True  # a is now most recent
    assert cache.touch("c") is False  # evicts b
    assert "b" not in cache and "a" in cache and len(cache) == 2
    assert cache.touch("b") is False


def test_gpu_util_grows_with_running_and_is_zero_idle():
    assert gpu_util_percent(0, 8) == 0.0
    values = [gpu_util_percent(n, 8) for n in range(1, 9)]
    assert values == sorted(values) and values[-1] == 100.0 and values[0] > 0
    assert gpu_util_percent(20, 8) == 100.0


def test_config_defaults_and_validation():
    cfg = BackendConfig(gpu_class="a10")
    assert cfg.gpu_memory_total_mib == 24576
    assert BackendConfig(gpu_memory_mib=40000).gpu_memory_total_mib == 40000
    for bad in (
        {"gpu_class": "v100"},
        {"gpu_memory_mib": 1000},
        {"long_tail": 1.5},
        {"time_scale": 0},
        {"max_concurrency": 0},
    ):
        with pytest.raises(ValueError):
            BackendConfig(**bad)
