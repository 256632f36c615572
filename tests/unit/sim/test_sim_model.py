"""Pure simulation model: latency table, time model, GPU classes, tokenizer, memory, prefix cache."""

import random

import pytest

from sim.config import BackendConfig
from sim.model import (
    GPU_CLASSES,
    PREFILL_MS_PER_TOKEN,
    REF_OUTPUT_TOKENS,
    REF_PROMPT_TOKENS,
    KvMemory,
    PrefixCache,
    base_latency_ms,
    block_hashes,
    decode_step_ms,
    draw_long_tail,
    estimate_tokens,
    gpu_util_percent,
    output_length,
    prefill_ms,
    request_latency_ms,
    session_tokens,
    time_factor,
    tokenize,
)

A100, A10, H100 = GPU_CLASSES["a100"], GPU_CLASSES["a10"], GPU_CLASSES["h100"]


@pytest.mark.parametrize(
    ("in_flight", "ms"),
    [(0, 50.0), (1, 50.0), (2, 95.0), (3, 157.5), (4, 220.0), (5, 282.5), (8, 470.0)],
)
def test_base_latency_table_interpolates_and_extrapolates(in_flight, ms):
    assert base_latency_ms(in_flight) == pytest.approx(ms)


@pytest.mark.parametrize(("in_flight", "ms"), [(1, 50.0), (2, 95.0), (4, 220.0)])
def test_short_request_keeps_the_field_figures_per_class(in_flight, ms):
    for gpu, factor in ((A100, 1.0), (A10, 2.5), (H100, 0.6)):
        scale = time_factor(gpu)
        got = request_latency_ms(REF_PROMPT_TOKENS, REF_OUTPUT_TOKENS, in_flight, scale)
        assert got == pytest.approx(factor * ms), gpu.key


def test_prefill_grows_with_uncached_tokens_and_decode_with_the_batch():
    assert prefill_ms(2000) == pytest.approx(2000 * PREFILL_MS_PER_TOKEN) == pytest.approx(200.0)
    assert prefill_ms(0) == 0.0 and prefill_ms(-3) == 0.0
    steps = [decode_step_ms(n) for n in (1, 2, 4, 8)]
    assert steps == sorted(steps) and steps[0] > 0
    # 64 output tokens cost 63 steps after the first token
    assert request_latency_ms(10, 64, 1) == pytest.approx(prefill_ms(10) + 63 * decode_step_ms(1))


def test_long_tail_slow_factor_and_time_scale_multiply():
    f = time_factor(A10, time_scale=0.1, slow_factor=3.0, long_tail=True)
    assert f == pytest.approx(2.5 * 0.1 * 3.0 * 10)
    assert decode_step_ms(2, f) == pytest.approx(decode_step_ms(2) * f)


def test_long_tail_draw_is_seeded_and_matches_probability():
    a = [draw_long_tail(random.Random(7), 0.5) for _ in range(3)]
    rng1, rng2 = random.Random(42), random.Random(42)
    assert [draw_long_tail(rng1, 0.3) for _ in range(50)] == [draw_long_tail(rng2, 0.3) for _ in range(50)]
    assert a[0] == a[1] == a[2]
    rng = random.Random(1)
    share = sum(draw_long_tail(rng, 0.2) for _ in range(5000)) / 5000
    assert 0.17 < share < 0.23
    assert not any(draw_long_tail(rng, 0.0) for _ in range(100))


def test_output_length_is_max_tokens_or_a_seeded_draw():
    assert output_length(random.Random(1), 40, 128) == 40
    draws = [output_length(random.Random(5), None, 128) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2] and 1 <= draws[0] <= 128


def test_tokenizer_rule_is_four_bytes_per_token_and_prefix_preserving():
    assert tokenize("") == [] and estimate_tokens("") == 1
    ids = tokenize("abcdefghij")
    assert len(ids) == 3 == estimate_tokens("abcdefghij")  # "abcd" "efgh" "ij"
    assert ids == tokenize("abcdefghij") and all(0 <= i < 32000 for i in ids)
    assert tokenize("abcdefgh") == ids[:2]
    assert len(tokenize("é" * 4)) == 2  # UTF-8 bytes, not characters
    long, longer = "system prompt " * 40, "system prompt " * 40 + "user: hi"
    assert tokenize(longer)[: len(tokenize(long)) - 1] == tokenize(long)[:-1]


def test_block_keys_chain_every_token_up_to_the_block():
    a = list(range(40))
    b = [*range(16), 99, *range(17, 40)]
    ka, kb = block_hashes(a), block_hashes(b)
    assert len(ka) == 2  # 40 tokens: two full blocks, the partial third has no key
    assert ka[0] == kb[0] and ka[1] != kb[1]
    c = [*range(16, 32), *range(16)]
    assert block_hashes(c)[1] != ka[0]  # same tokens, other position: another key
    assert block_hashes(a) == ka


def test_text_that_is_not_valid_unicode_still_tokenizes():
    assert len(tokenize("a\ud800b")) == 2 and estimate_tokens("\udcff" * 4) == 3
    assert session_tokens("\udcff\udcfesession", 16) != session_tokens("session", 16)


def test_session_tokens_are_deterministic_per_key():
    assert session_tokens("alice", 400) == session_tokens("alice", 400)
    assert len(session_tokens("alice", 400)) == 400 and session_tokens("x", 0) == []
    assert session_tokens("alice", 16) != session_tokens("bob", 16)


def test_prefix_cache_counts_references_and_evicts_unused_lru_first():
    c = PrefixCache()
    c.acquire([1, 2, 3])
    assert c.match([1, 2, 3, 4]) == 3 and c.match([9, 1]) == 0
    assert c.used_blocks == 3 and c.free_blocks == 0
    assert c.evict(5) == 0  # blocks in use never go
    c.release([1, 2, 3])  # finished: they stay cached, unused
    assert len(c) == 3 and c.free_blocks == 3
    c.acquire([1])  # reused: in use again
    c.release([1])  # ... and now the most recently used
    assert c.evict(2) == 2
    assert 1 in c and 2 not in c and 3 not in c


def test_kv_memory_evicts_cached_blocks_only_when_the_room_is_needed():
    mem = KvMemory(total_mib=14336 + 100, weights_mib=14336, kv_mib_per_token=0.5, block_size=16)  # 12.5 blocks
    assert mem.block_mib == 8.0
    mem.cache.acquire(list(range(10)))  # 80 MiB of blocks
    assert mem.held_mib == 80 and mem.kv_usage == pytest.approx(0.8)
    mem.cache.release(list(range(10)))
    assert mem.held_mib == 0 and mem.cached_free_mib == 80 and mem.free_mib == 100  # evictable = free
    assert mem.make_room(20) and len(mem.cache) == 10  # 20 MiB were unallocated already
    assert mem.make_room(36) and len(mem.cache) == 8 and mem.evicted_blocks == 2  # LRU blocks 0, 1 went
    assert 0 not in mem.cache and 9 in mem.cache
    assert not mem.make_room(101) and len(mem.cache) == 8  # cannot fit: nothing evicted


def test_explicit_reservations_admit_up_to_the_limit_and_no_further():
    mem = KvMemory(total_mib=24576, weights_mib=14336)
    assert mem.kv_capacity_mib == 10240
    assert mem.try_reserve(8192)
    assert not mem.try_reserve(2049)  # would exceed total by 1 MiB
    assert mem.held_mib == 8192  # a refused request changes nothing
    assert mem.try_reserve(2048)  # exactly at the limit
    assert mem.free_mib == 0 and mem.kv_usage == 1.0
    assert not mem.try_reserve(0.5)
    mem.release(8192)
    mem.release(2048)
    assert mem.held_mib == 0 and mem.used_mib == 14336 and mem.kv_usage == 0.0


def test_eighteen_gib_request_fits_a100_but_not_a10():
    assert not KvMemory(GPU_CLASSES["a10"].memory_mib, 14336).try_reserve(18432)
    assert KvMemory(GPU_CLASSES["a100"].memory_mib, 14336).try_reserve(18432)


def test_gpu_class_memory():
    assert (A100.memory_mib, A10.memory_mib, H100.memory_mib) == (81920, 24576, 81920)
    assert A10.dcgm_model_name == "NVIDIA A10"


def test_gpu_util_grows_with_running_and_is_zero_idle():
    assert gpu_util_percent(0, 8) == 0.0
    values = [gpu_util_percent(n, 8) for n in range(1, 9)]
    assert values == sorted(values) and values[-1] == 100.0 and values[0] > 0
    assert gpu_util_percent(20, 8) == 100.0


def test_config_defaults_and_validation():
    cfg = BackendConfig(gpu_class="a10")
    assert cfg.gpu_memory_total_mib == 24576
    assert cfg.oom_mode == "error" and cfg.prefix_caching and cfg.block_size == 16
    assert BackendConfig(gpu_memory_mib=40000).gpu_memory_total_mib == 40000
    for bad in (
        {"gpu_class": "v100"},
        {"gpu_memory_mib": 1000},
        {"long_tail": 1.5},
        {"time_scale": 0},
        {"max_concurrency": 0},
        {"oom_mode": "crash"},
        {"block_size": 0},
        {"session_history_tokens": -1},
    ):
        with pytest.raises(ValueError):
            BackendConfig(**bad)
