"""SimNode without HTTP: FIFO queue, latency at start, sessions, OOM, cancellation, faults."""

import asyncio

import pytest

from sim.config import BackendConfig
from sim.faults import FaultError, FaultState, parse_fault_patch
from sim.gate import ConcurrencyGate
from sim.node import OutOfMemory, SimNode
from sim.protocol import InferenceRequest, RequestError, parse_request, resolve_session_key


def _req(session=None, max_tokens=16, memory=None):
    return InferenceRequest("chat", max_tokens, 4, None, None, session, memory)


async def _wait_until(cond, timeout=2.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


async def test_latency_decided_from_running_count_at_start():
    node = SimNode(BackendConfig(gpu_class="a10", time_scale=0.05, seed=1))
    done = await asyncio.gather(*(node.serve(_req(session=f"s{i}")) for i in range(4)))
    # all new sessions: +40 ms penalty; a10 = 2.5x; started with 1, 2, 3, 4 running
    expected = [(base + 40.0) * 2.5 * 0.05 for base in (50.0, 95.0, 157.5, 220.0)]
    assert [c.plan.service_ms for c in done] == pytest.approx(expected)
    assert node.gate.running == 0 and node.memory.held_mib == 0


async def test_fifo_queue_beyond_max_concurrency():
    node = SimNode(BackendConfig(max_concurrency=2, time_scale=0.1))
    tasks = [asyncio.create_task(node.serve(_req(session="same"))) for _ in range(5)]
    await _wait_until(lambda: node.gate.running == 2)
    assert node.gate.waiting == 3
    done = await asyncio.gather(*tasks)
    assert all(c.queue_s < 0.003 for c in done[:2])
    assert done[2].queue_s > 0 and done[4].queue_s > done[2].queue_s
    # queued requests never see more than max_concurrency running
    assert max(c.plan.service_ms for c in done) <= (95.0 + 40.0) * 0.1 + 1e-9


async def test_returning_session_skips_prefill_penalty_and_is_counted():
    node = SimNode(BackendConfig(time_scale=0.05))
    cold = await node.serve(_req(session="alice"))
    warm = await node.serve(_req(session="alice"))
    assert not cold.plan.session_hit and warm.plan.session_hit
    assert cold.plan.service_ms - warm.plan.service_ms == pytest.approx(40.0 * 0.05)
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
        return [(await node.serve(_req(session="s"))).plan.long_tail for _ in range(12)]

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
    assert parse_request("completion", b"{}", {"x-sim-memory-mib": "8192"}).max_tokens == 128
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
