"""SimNode without HTTP: the engine on the wall clock, sessions, OOM and refusals, cancellation, faults."""

import asyncio

import pytest

from sim.config import BackendConfig
from sim.engines.hardware import GPU_CLASSES, MODELS, step_coefficients
from sim.engines.job import REF_OUTPUT_TOKENS, REF_PROMPT_TOKENS
from sim.faults import FaultError, FaultState, parse_fault_patch
from sim.node import EngineRefused, SimNode
from sim.protocol import InferenceRequest, RequestError, parse_request, resolve_session_key

A100 = step_coefficients(MODELS["llama-3.1-8b"], GPU_CLASSES["a100"])


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


async def test_a_short_request_alone_takes_the_seed_figure_on_a_job_node():
    node = SimNode(BackendConfig(engine="job", gpu_class="a10", time_scale=0.4, seed=1, session_history_tokens=0))
    done = await node.serve(_req(tokens=_prompt(1, REF_PROMPT_TOKENS), max_tokens=REF_OUTPUT_TOKENS))
    assert _took(done.e2e_s, 50.0 * 2.5 * 0.4), done.e2e_s
    assert done.completion_tokens == 16 and done.finish_reason == "length" and done.cached_tokens == 0
    assert node.stats().running == 0 and node.stats().memory_used_mib == 14336


async def test_an_llm_node_runs_its_engine_on_the_wall_clock():
    """A lone request: TTFT = one prefill step, then one decode step per token (A100 fits), x time scale."""
    node = SimNode(BackendConfig(time_scale=0.2, session_history_tokens=0))
    done = await node.serve(_req(tokens=_prompt(1, 200), max_tokens=40))
    step = A100.step_s(0, 1) * 1000 * 0.2
    assert _took(done.ttft_s, A100.step_s(200, 0) * 1000 * 0.2), done.ttft_s
    assert _took(done.e2e_s, A100.step_s(200, 0) * 1000 * 0.2 + 39 * step), done.e2e_s
    assert node.state()["kv_cache"]["blocks_used"] == 0


async def test_a_batch_of_sixteen_decodes_almost_as_fast_as_one():
    node = SimNode(BackendConfig(time_scale=0.2, session_history_tokens=0))
    alone = await node.serve(_req(tokens=_prompt(1, 64), max_tokens=64))
    batch = await asyncio.gather(*(node.serve(_req(tokens=_prompt(2 + i, 64), max_tokens=64)) for i in range(16)))
    tpot_alone = (alone.e2e_s - alone.ttft_s) / 63
    tpot_batch = max((c.e2e_s - c.ttft_s) / 63 for c in batch)
    assert tpot_batch < 1.3 * tpot_alone


async def test_prefix_reuse_lowers_ttft_by_the_skipped_prefill():
    node = SimNode(BackendConfig(time_scale=0.5, session_history_tokens=0))
    prompt = _prompt(3, 2000)  # 125 full blocks
    cold = await node.serve(_req(tokens=prompt, max_tokens=2))
    warm = await node.serve(_req(tokens=(*prompt, 5, 6, 7), max_tokens=2))  # same prefix, a new question
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 2000)
    skipped = A100.step_s(2000, 0) - A100.step_s(3, 0)
    assert (cold.ttft_s - warm.ttft_s) == pytest.approx(skipped * 0.5, abs=0.03)


async def test_a_full_kv_cache_queues_requests_instead_of_failing():
    node = SimNode(BackendConfig(gpu_class="a10", time_scale=0.02, session_history_tokens=0))
    tasks = [asyncio.create_task(node.serve(_req(tokens=_prompt(10 + i, 4000), max_tokens=100))) for i in range(12)]
    await _wait_until(lambda: node.stats().waiting > 0, timeout=5.0)
    done = await asyncio.gather(*tasks)
    assert len(done) == 12 and node.counters["oom"] == 0


async def test_fifo_queue_beyond_max_concurrency_on_a_job_node():
    node = SimNode(BackendConfig(engine="job", max_concurrency=2, time_scale=0.1))
    # long enough (256 tokens) that no job ends between the poll and the snapshot on a loaded machine
    tasks = [asyncio.create_task(node.serve(_req(session="same", max_tokens=256))) for _ in range(5)]
    await _wait_until(lambda: node.stats().running == 2)
    assert node.stats().waiting == 3
    done = await asyncio.gather(*tasks)
    assert all(c.queue_s < 0.003 for c in done[:2])
    assert done[2].queue_s > 0 and done[4].queue_s > done[2].queue_s


async def test_returning_session_skips_its_history_prefill_and_is_counted():
    node = SimNode(BackendConfig(time_scale=0.5))  # a session stands for 400 tokens of history
    cold = await node.serve(_req(session="alice"))
    warm = await node.serve(_req(session="alice"))
    assert cold.session_hit is False and warm.session_hit is True
    assert (cold.ttft_s - warm.ttft_s) == pytest.approx(A100.beta1_us * 400e-6 * 0.5, abs=0.012)
    assert node.counters["session_hits"] == 1 and node.counters["session_misses"] == 1
    exposition = node.metrics.render(node.gauges()).decode()
    assert "inferlb_sim_session_cache_hits_total 1.0" in exposition
    assert "inferlb_sim_session_cache_misses_total 1.0" in exposition


async def test_oom_is_immediate_and_counted_on_a_job_node():
    node = SimNode(BackendConfig(engine="job", gpu_class="a10", time_scale=0.2))
    first = asyncio.create_task(node.serve(_req(memory=8192)))
    await _wait_until(lambda: node.stats().running == 1)
    with pytest.raises(EngineRefused) as err:
        await node.serve(_req(memory=8192))
    assert err.value.reason == "oom" and "CUDA out of memory. Tried to allocate 8192 MiB" in str(err.value)
    assert node.counters["oom"] == 1
    assert node.stats().memory_used_mib == 14336 + 8192
    await first
    assert node.stats().memory_used_mib == 14336
    assert "inferlb_sim_oom_total 1.0" in node.metrics.render(node.gauges()).decode()


async def test_a_prompt_longer_than_the_context_is_refused():
    node = SimNode(BackendConfig(gpu_class="a10", time_scale=0.2, session_history_tokens=0))
    with pytest.raises(EngineRefused) as err:
        await node.serve(_req(tokens=_prompt(1, 30000), max_tokens=10))
    assert err.value.reason == "context_length" and node.counters["refused"] == 1 and not node.spans


async def test_cancel_while_running_and_while_queued_releases_everything():
    node = SimNode(BackendConfig(engine="job", max_concurrency=1, time_scale=10.0))
    running = asyncio.create_task(node.serve(_req(memory=1000)))
    queued = asyncio.create_task(node.serve(_req(memory=2000)))
    await _wait_until(lambda: node.stats().running == 1 and node.stats().waiting == 1)
    assert node.stats().memory_used_mib == 14336 + 3000
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert node.stats().waiting == 0 and node.stats().memory_used_mib == 14336 + 1000
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    assert node.stats().running == 0 and node.stats().memory_used_mib == 14336
    assert node.counters["cancelled"] == 2


async def test_a_cancelled_llm_request_gives_its_blocks_back():
    node = SimNode(BackendConfig(time_scale=1.0, session_history_tokens=0))
    task = asyncio.create_task(node.serve(_req(tokens=_prompt(9, 500), max_tokens=500)))
    await _wait_until(lambda: node.state()["kv_cache"]["blocks_used"] > 0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert node.state()["kv_cache"]["blocks_used"] == 0 and node.stats().running == 0


async def test_slow_factor_fault_slows_the_engine_from_now_on():
    node = SimNode(BackendConfig(time_scale=0.2, session_history_tokens=0))
    fast = await node.serve(_req(tokens=_prompt(1, 16), max_tokens=30))
    node.apply_faults({"slow_factor": 3.0})
    slow = await node.serve(_req(tokens=_prompt(2, 16), max_tokens=30))
    assert slow.e2e_s > 2.5 * fast.e2e_s


async def test_hang_fault_holds_requests_until_cleared():
    node = SimNode(BackendConfig(time_scale=0.05))
    node.faults.apply({"hang": True})
    task = asyncio.create_task(node.serve(_req()))
    await asyncio.sleep(0.05)
    assert not task.done() and node.hung == 1 and node.stats().running == 0
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
