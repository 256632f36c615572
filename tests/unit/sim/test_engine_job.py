"""The job engine: the seed's per-request GPU server (50 / 95 / 220 ms, memory per request, OOM)."""

from __future__ import annotations

import pytest

from sim.engines.api import FAIL_OOM, EngineRequest, Failed, Finished, FirstToken, Tokens
from sim.engines.job import (
    PREFILL_MS_PER_TOKEN,
    REF_OUTPUT_TOKENS,
    REF_PROMPT_TOKENS,
    JobEngine,
    base_latency_ms,
    decode_step_ms,
    prefill_ms,
    request_latency_ms,
)

GIB = 1024.0
SHORT = tuple(range(REF_PROMPT_TOKENS))


def run(eng: JobEngine, until: float = 1e9) -> list:
    events = []
    while (t := eng.next_event_s()) is not None and t <= until:
        events += eng.advance(t)
    return events


@pytest.mark.parametrize(
    ("running", "ms"),
    [(0, 50.0), (1, 50.0), (2, 95.0), (3, 157.5), (4, 220.0), (5, 282.5), (8, 470.0)],
)
def test_the_seed_latency_table_interpolates_and_extrapolates(running, ms):
    assert base_latency_ms(running) == pytest.approx(ms)


@pytest.mark.parametrize(("gpu", "factor"), [("a100", 1.0), ("a10", 2.5), ("h100", 0.6), ("l4", 5.0)])
@pytest.mark.parametrize(("n", "ms"), [(1, 50.0), (2, 95.0), (4, 220.0)])
def test_n_short_requests_together_take_the_seed_figures(gpu, factor, n, ms):
    """The seed's short request: 50 ms alone, 95 ms with 2 running, 220 ms with 4 (x the class factor)."""
    eng = JobEngine(gpu)
    for i in range(n):
        eng.submit(EngineRequest(f"r{i}", SHORT, REF_OUTPUT_TOKENS, 0.0), 0.0)
    done = [e for e in run(eng) if isinstance(e, Finished)]
    assert len(done) == n
    assert all(e.time_s * 1000 == pytest.approx(factor * ms) for e in done)


def test_time_model():
    assert prefill_ms(2000) == pytest.approx(2000 * PREFILL_MS_PER_TOKEN) == pytest.approx(200.0)
    steps = [decode_step_ms(n) for n in (1, 2, 4, 8)]
    assert steps == sorted(steps) and steps[0] > 0
    assert request_latency_ms(10, 64, 1) == pytest.approx(prefill_ms(10) + 63 * decode_step_ms(1))


def test_each_request_added_lowers_tokens_per_second():
    """Unlike a batching engine: 4 running produce fewer tokens/s than 1 (4 x 16 / 220 ms < 16 / 50 ms)."""
    assert 4 * REF_OUTPUT_TOKENS / base_latency_ms(4) < REF_OUTPUT_TOKENS / base_latency_ms(1)


def test_slots_queue_first_come_first_served():
    eng = JobEngine("a100", max_concurrency=2)
    for i in range(3):
        eng.submit(EngineRequest(f"r{i}", SHORT, REF_OUTPUT_TOKENS, 0.0), 0.0)
    assert (eng.stats().running, eng.stats().waiting) == (2, 1)
    done = {e.request_id: e for e in run(eng) if isinstance(e, Finished)}
    assert done["r0"].time_s == pytest.approx(0.095) and done["r2"].time_s == pytest.approx(0.145)
    assert done["r2"].queue_s == pytest.approx(0.095)


def test_declared_memory_is_reserved_at_arrival_and_refused_when_it_does_not_fit():
    """24 GiB free next to the weights: an 18 GiB job and an 8 GiB one do not fit together (seed
    section 3.3's trap): the second is refused at once with CUDA out of memory."""
    eng = JobEngine("a10", gpu_memory_mib=14336 + 24 * GIB)
    eng.submit(EngineRequest("big", (1,), 16, 0.0, memory_mib=18 * GIB), 0.0)
    eng.submit(EngineRequest("small", (1,), 16, 0.0, memory_mib=8 * GIB), 0.0)
    [fail] = eng.advance(0.0)
    assert isinstance(fail, Failed) and fail.reason == FAIL_OOM and fail.request_id == "small"
    assert "CUDA out of memory. Tried to allocate 8192 MiB" in fail.detail
    assert eng.stats().memory_free_mib == pytest.approx(6 * GIB)
    run(eng)
    assert eng.stats().memory_free_mib == pytest.approx(24 * GIB) and eng.stats().failed == 1


def test_kv_memory_of_prompt_and_output_is_held_from_the_start():
    eng = JobEngine("a100", gpu_memory_mib=14336 + 1000, kv_mib_per_token=0.5)
    eng.submit(EngineRequest("a", tuple(range(1000)), 900, 0.0), 0.0)
    eng.submit(EngineRequest("b", tuple(range(100)), 10, 0.0), 0.0)  # 55 MiB more: 1005 > 1000
    events = run(eng)
    assert [e.request_id for e in events if isinstance(e, Failed)] == ["b"]
    assert [e.request_id for e in events if isinstance(e, Finished)] == ["a"]


def test_tokens_stream_and_add_up():
    eng = JobEngine("a100", stream=True)
    eng.submit(EngineRequest("a", SHORT, 100, 0.0), 0.0)
    events = []
    t = 0.0
    while eng.next_event_s() is not None:
        t += 0.02
        events += eng.advance(t)
    assert isinstance(events[0], FirstToken)
    toks = [e for e in events if isinstance(e, Tokens)]
    assert len(toks) > 5 and sum(e.count for e in toks) == 99
    assert all(e.itl_s == pytest.approx(decode_step_ms(1) / 1000, rel=0.01) for e in toks[1:-1])


def test_slow_factor_and_slowdown_stretch_new_requests():
    eng = JobEngine("a100")
    eng.set_slow_factor(3.0, 0.0)
    eng.submit(EngineRequest("slow", SHORT, REF_OUTPUT_TOKENS, 0.0, slowdown=2.0), 0.0)
    [done] = [e for e in run(eng) if isinstance(e, Finished)]
    assert done.time_s == pytest.approx(0.050 * 6)


def test_cancel_frees_slot_and_memory():
    eng = JobEngine("a100", max_concurrency=1)
    eng.submit(EngineRequest("a", SHORT, 1000, 0.0, memory_mib=1000), 0.0)
    eng.submit(EngineRequest("b", SHORT, REF_OUTPUT_TOKENS, 0.0), 0.0)
    eng.cancel("a", 0.01)
    done = [e for e in run(eng) if isinstance(e, Finished)]
    assert [e.request_id for e in done] == ["b"] and done[0].time_s == pytest.approx(0.060)
    assert eng.stats().memory_used_mib == 14336
