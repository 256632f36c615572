"""SimNode without HTTP: FIFO queue, latency at start, sessions, OOM, cancellation, faults."""

import asyncio

import pytest

from sim.config import BackendConfig
from sim.faults import FaultError, FaultState, parse_fault_patch
from sim.gate import ConcurrencyGate
from sim.model import REF_OUTPUT_TOKENS, REF_PROMPT_TOKENS, decode_step_ms, prefill_ms
from sim.node import OutOfMemory, SimNode
from sim.protocol import InferenceRequest, RequestError, parse_request, resolve_session_key


def _req(session=None, max_tokens=16, memory=None, tokens=None):
    toks = tuple(tokens) if tokens is not None else (1, 2, 3, 4)
    return InferenceRequest("chat", max_tokens, len(toks), None, None, session, memory, toks)


def _prompt(tag: int, n: int) -> tuple[int, ...]:
    return tuple((tag * 7919 + i) % 32000 for i in range(n))


def _took(measured_s: float, planned_ms: float, late_ms: float = 30.0) -> bool:
    """A wall-clock time matches the model's plan: never early, at most ``late_ms`` late (a loaded
    machine's event loop wakes late, never early)."""
    return planned_ms - 2.0 <= measured_s * 1000 <= planned_ms + late_ms


async def _wait_until(cond, timeout=2.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


async def test_a_short_request_alone_takes_the_field_figure():
    node = SimNode(BackendConfig(gpu_class="a10", time_scale=0.4, seed=1, session_history_tokens=0))
    done = await node.serve(_req(tokens=_prompt(1, REF_PROMPT_TOKENS), max_tokens=REF_OUTPUT_TOKENS))
    assert _took(done.e2e_s, 50.0 * 2.5 * 0.4), done.e2e_s
    assert done.completion_tokens == 16 and done.finish_reason == "length" and done.cached_tokens == 0
    assert node.gate.running == 0 and node.memory.held_mib == 0


async def test_decode_slows_down_with_the_running_batch():
    node = SimNode(BackendConfig(time_scale=0.5, session_history_tokens=0))
    alone = await node.serve(_req(tokens=_prompt(1, 16), max_tokens=32))
    four = await asyncio.gather(*(node.serve(_req(tokens=_prompt(2 + i, 16), max_tokens=32)) for i in range(4)))
    tpot_alone = (alone.e2e_s - alone.ttft_s) / 31
    tpot_four = min((c.e2e_s - c.ttft_s) / 31 for c in four)
    for measured, batch in ((tpot_alone, 1), (tpot_four, 4)):   # never early; late by at most 40 % + 1 ms
        planned = decode_step_ms(batch, 0.5)
        assert 0.95 * planned <= measured * 1000 <= 1.4 * planned + 1.0, (batch, measured, planned)
    assert tpot_four > tpot_alone


async def test_prefix_reuse_lowers_ttft_by_the_skipped_prefill():
    node = SimNode(BackendConfig(time_scale=1.0, session_history_tokens=0))
    prompt = _prompt(3, 2000)  # 125 full blocks; 200 ms of prefill on an A100
    cold = await node.serve(_req(tokens=prompt, max_tokens=2))
    warm = await node.serve(_req(tokens=(*prompt, 5, 6, 7), max_tokens=2))  # same prefix, a new question
    assert cold.cached_tokens == 0 and warm.cached_tokens == 2000
    skipped_ms = prefill_ms(2000)
    assert (cold.ttft_s - warm.ttft_s) * 1000 == pytest.approx(skipped_ms, abs=20.0)
    assert _took(cold.ttft_s, 200.0), cold.ttft_s
    assert node.counters["prefix_queried_tokens"] == 2000 + 2003
    assert node.counters["prefix_hit_tokens"] == 2000
    text = node.metrics.render(node.gauges()).decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim-7b"} 4003.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-7b"} 2000.0' in text
    # an identical prompt still computes its last token (vLLM recomputes at least one)
    again = await node.serve(_req(tokens=prompt, max_tokens=2))
    assert again.cached_tokens == 2000 - 16


async def test_cached_prefixes_are_evicted_lru_under_kv_pressure():
    # 200 MiB of KV = 25 blocks of 16 tokens; each prompt is 10 blocks
    node = SimNode(BackendConfig(gpu_memory_mib=14336 + 200, time_scale=0.01, session_history_tokens=0))
    a, b, c = (_prompt(t, 160) for t in (10, 11, 12))
    for p in (a, b):
        await node.serve(_req(tokens=p, max_tokens=2))
    assert len(node.memory.cache) == 20 and node.memory.kv_usage == 0.0  # cached, in use by nobody
    await node.serve(_req(tokens=b, max_tokens=2))  # b is now the most recently used
    await node.serve(_req(tokens=c, max_tokens=2))  # needs 10 blocks: a's go first
    assert node.memory.evicted_blocks >= 5
    hit_b = await node.serve(_req(tokens=b, max_tokens=2))
    hit_a = await node.serve(_req(tokens=a, max_tokens=2))
    assert hit_b.cached_tokens == 160 - 16 and hit_a.cached_tokens == 0
    assert node.state()["prefix_cache"]["evicted_blocks"] == node.memory.evicted_blocks


async def test_kv_overflow_is_oom_or_preemption_as_configured():
    small = {"gpu_memory_mib": 14336 + 100, "time_scale": 0.2, "session_history_tokens": 0}  # 200 tokens
    node = SimNode(BackendConfig(**small))
    first = asyncio.create_task(node.serve(_req(tokens=_prompt(1, 16), max_tokens=120)))
    await _wait_until(lambda: node.gate.running == 1)
    with pytest.raises(OutOfMemory):  # 16 + 120 tokens are reserved by the first; 136 more do not fit
        await node.serve(_req(tokens=_prompt(2, 16), max_tokens=120))
    await first
    assert node.counters["oom"] == 1 and node.counters["preemptions"] == 0

    node = SimNode(BackendConfig(**small, oom_mode="preempt"))
    done = await asyncio.gather(*(node.serve(_req(tokens=_prompt(i, 16), max_tokens=120)) for i in range(2)))
    assert [c.completion_tokens for c in done] == [120, 120]
    assert node.counters["oom"] == 0 and node.counters["preemptions"] >= 1
    assert sum(c.preemptions for c in done) == node.counters["preemptions"]
    assert node.memory.held_mib == 0 and node.gate.running == 0
    assert "vllm:num_preemptions_total" in node.metrics.render(node.gauges()).decode()


async def test_fifo_queue_beyond_max_concurrency():
    node = SimNode(BackendConfig(max_concurrency=2, time_scale=0.1))
    tasks = [asyncio.create_task(node.serve(_req(session="same"))) for _ in range(5)]
    await _wait_until(lambda: node.gate.running == 2)
    assert node.gate.waiting == 3
    done = await asyncio.gather(*tasks)
    assert all(c.queue_s < 0.003 for c in done[:2])
    assert done[2].queue_s > 0 and done[4].queue_s > done[2].queue_s


async def test_returning_session_skips_its_history_prefill_and_is_counted():
    node = SimNode(BackendConfig(time_scale=0.5))  # a session stands for 400 tokens of history
    cold = await node.serve(_req(session="alice"))
    warm = await node.serve(_req(session="alice"))
    assert cold.session_hit is False and warm.session_hit is True
    assert (cold.ttft_s - warm.ttft_s) * 1000 == pytest.approx(prefill_ms(400, 0.5), abs=12.0)  # 20 ms
    assert node.counters["session_hits"] == 1 and node.counters["session_misses"] == 1
    exposition = node.metrics.render(node.gauges()).decode()
    assert "inferlb_sim_session_cache_hits_total 1.0" in exposition
    assert "inferlb_sim_session_cache_misses_total 1.0" in exposition


async def test_oom_is_immediate_and_counted():
    node = SimNode(BackendConfig(gpu_class="a10", time_scale=0.2))
    first = asyncio.create_task(node.serve(_req(memory=8192)))
    await _wait_until(lambda: node.gate.running == 1)
    with pytest.raises(OutOfMemory) as err:
        await node.serve(_req(memory=8192))
    assert "CUDA out of memory. Tried to allocate 8192 MiB" in str(err.value)
    assert node.counters["oom"] == 1
    assert node.memory.held_mib == 8192
    await first
    assert node.memory.held_mib == 0
    assert "inferlb_sim_oom_total 1.0" in node.metrics.render(node.gauges()).decode()


async def test_cancel_while_running_and_while_queued_releases_everything():
    node = SimNode(BackendConfig(max_concurrency=1, time_scale=10.0))
    running = asyncio.create_task(node.serve(_req(memory=1000)))
    queued = asyncio.create_task(node.serve(_req(memory=2000)))
    await _wait_until(lambda: node.gate.running == 1 and node.gate.waiting == 1)
    assert node.memory.held_mib == 3000
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert node.gate.waiting == 0 and node.memory.held_mib == 1000
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert node.gate.running == 0 and node.memory.held_mib == 0
    assert node.counters["cancelled"] == 2


async def test_gate_hands_slot_to_next_waiter_even_if_cancelled_after_grant():
    gate = ConcurrencyGate(1)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # slot handed to waiter
    waiter.cancel()  # ... which is cancelled before it resumes
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.running == 0 and gate.waiting == 0


async def test_hang_fault_holds_requests_until_cleared():
    node = SimNode(BackendConfig(time_scale=0.05))
    node.faults.apply({"hang": True})
    task = asyncio.create_task(node.serve(_req()))
    await asyncio.sleep(0.05)
    assert not task.done() and node.hung == 1 and node.gate.running == 0
    node.faults.apply({"hang": False})
    await asyncio.wait_for(task, 1.0)
    assert node.hung == 0


async def test_long_tail_fault_and_seed_make_runs_reproducible():
    async def run(seed):
        node = SimNode(BackendConfig(time_scale=0.01, seed=seed, long_tail=0.5))
        return [(await node.serve(_req(session="s"))).long_tail for _ in range(12)]

    first = await run(3)
    assert first == await run(3)
    assert any(first) and not all(first)


def test_fault_patch_validation():
    assert parse_fault_patch({"hang": True, "metrics": "error"}) == {"hang": True, "metrics": "error"}
    for bad, field in [
        ({"hang": "yes"}, "hang"),
        ({"metrics": "down"}, "metrics"),
        ({"slow_factor": 0}, "slow_factor"),
        ({"long_tail": 2}, "long_tail"),
        ({"explode": True}, "explode"),
        ([1], "body"),
    ]:
        with pytest.raises(FaultError) as err:
            parse_fault_patch(bad)
        assert err.value.field == field


async def test_fault_reset_restores_configured_long_tail():
    faults = FaultState(long_tail=0.1)
    faults.apply({"hang": True, "slow_factor": 4.0, "long_tail": 0.9, "metrics": "hang"})
    faults.apply({"reset": True})
    assert faults.as_dict() == {"hang": False, "metrics": "ok", "push": "ok", "etcd": "ok", "slow_factor": 1.0,
                                "long_tail": 0.1}


def test_parse_request_fields_and_errors():
    req = parse_request("chat", b'{"max_tokens": 7, "user": "bob", "messages": []}', {})
    assert (req.max_tokens, req.user, req.session_key, req.memory_mib) == (7, "bob", "bob", None)
    bare = parse_request("completion", b"{}", {"x-sim-memory-mib": "8192"})
    assert bare.max_tokens == 128 and not bare.max_tokens_given and not bare.stream
    chat = parse_request("chat", b'{"messages": [{"role": "system", "content": "be brief"}], "stream": true, '
                                 b'"stream_options": {"include_usage": true}, "max_completion_tokens": 3}', {})
    assert chat.stream and chat.include_usage and chat.max_tokens == 3
    assert chat.prompt_tokens == len(chat.tokens) == 9  # "<|system|>\nbe brief\n<|assistant|>\n" = 34 bytes
    cases = [
        (b"", {}, "body"),
        (b"{bad", {}, "body"),
        (b"[1, 2]", {}, "body"),
        (b'{"max_tokens": "ten"}', {}, "max_tokens"),
        (b'{"max_tokens": 0}', {}, "max_tokens"),
        (b'{"max_tokens": true}', {}, "max_tokens"),
        (b'{"user": 5}', {}, "user"),
        (b'{"model": []}', {}, "model"),
        (b'{"messages": "hi"}', {}, "messages"),
        (b'{"stream": "yes"}', {}, "stream"),
        (b'{"stream_options": []}', {}, "stream_options"),
        (b'{"max_completion_tokens": -1}', {}, "max_completion_tokens"),
        (b"{}", {"x-sim-memory-mib": "lots"}, "x-sim-memory-mib"),
        (b"{}", {"x-sim-memory-mib": "-1"}, "x-sim-memory-mib"),
    ]
    for raw, headers, field in cases:
        with pytest.raises(RequestError) as err:
            parse_request("chat", raw, headers)
        assert err.value.field == field, raw


def test_session_key_precedence():
    assert resolve_session_key({"x-session-id": "s", "x-user-id": "u"}, "b") == "s"
    assert resolve_session_key({"x-user-id": "u"}, "b") == "u"
    assert resolve_session_key({}, "b") == "b"
    assert resolve_session_key({}, None) is None


async def test_a_request_cancelled_during_prefill_leaves_no_uncomputed_blocks():
    node = SimNode(BackendConfig(time_scale=1.0, session_history_tokens=0))
    prompt = _prompt(9, 2000)
    task = asyncio.create_task(node.serve(_req(tokens=prompt, max_tokens=2)))
    await _wait_until(lambda: node.gate.running == 1)
    await asyncio.sleep(0.02)  # inside its 200 ms prefill
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(node.memory.cache) == 0 and node.memory.held_mib == 0
    done = await node.serve(_req(tokens=prompt, max_tokens=2))
    assert done.cached_tokens == 0 and len(node.memory.cache) == 125
