"""``loadgen.replay``: open loop (sends on schedule whatever the answers), headers, outcomes, timeouts."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from inferlb.devstack.loadgen import Planned, Session, replay


async def _server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"


async def test_requests_go_out_on_schedule_even_while_earlier_ones_are_unanswered():
    arrivals: list[float] = []
    began = time.monotonic()

    async def slow(request: web.Request) -> web.Response:
        arrivals.append(time.monotonic() - began)
        await asyncio.sleep(0.4)
        return web.json_response({}, headers={"x-served-by": "n1", "x-backend-version": "v1"})

    runner, url = await _server(slow)
    try:
        trace = [Planned(0.05 * i, Session(f"s{i}", "v1")) for i in range(6)]
        traffic = await replay(url, trace, timeout_s=5)
    finally:
        await runner.cleanup()
    assert len(arrivals) == 6
    assert max(arrivals) < 0.4, "the last request waited for an answer: not open loop"
    assert sorted(r.index for r in traffic.results) == list(range(6))
    assert all(r.status == 200 and r.error is None and r.served_by == "n1" for r in traffic.results)
    assert all(r.latency_ms >= 390 for r in traffic.results)
    assert traffic.max_lag_ms < 200


async def test_headers_errors_and_timeouts_are_recorded():
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        if request.headers.get("x-sim-memory-mib") == "18432":
            return web.json_response({"error": {"type": "oom", "message": "CUDA out of memory"}}, status=500)
        if request.headers.get("x-session-id") == "hang":
            await asyncio.sleep(5)
        return web.json_response({})

    runner, url = await _server(handler)
    try:
        trace = [Planned(0.0, Session("a", "v2"), {"x-sim-memory-mib": "18432"}, 16),
                 Planned(0.01, Session(None, None)),
                 Planned(0.02, Session("hang", None))]
        traffic = await replay(url, trace, timeout_s=0.5)
    finally:
        await runner.cleanup()
    by_index = {r.index: r for r in traffic.results}
    assert (by_index[0].status, by_index[0].error) == (500, "oom")
    assert (by_index[1].status, by_index[1].error) == (200, None)
    assert (by_index[2].status, by_index[2].error) == (0, "timeout")
    sent = sorted((h.get("x-session-id", ""), h.get("model-version", ""), h.get("x-sim-memory-mib", "")) for h in seen)
    assert sent == [("", "", ""), ("a", "v2", "18432"), ("hang", "", "")]


async def test_streamed_requests_record_ttft_tpot_and_usage_from_a_real_sim():
    from sim.config import BackendConfig
    from sim.server import start_backend

    runner, port = await start_backend(BackendConfig(port=0, time_scale=1.0, session_history_tokens=0))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    system = [{"role": "system", "content": "x" * 4000}]  # 1 007 tokens: 65 ms of A100 prefill when not cached
    try:
        trace = [Planned(0.0, Session(None, None), {}, 20, system, True),
                 Planned(0.3, Session(None, None), {}, 20, system, True),
                 Planned(0.6, Session(None, None), {}, 20, system, False)]
        traffic = await replay(url, trace, timeout_s=5)
    finally:
        await runner.cleanup()
    r = {x.index: x for x in traffic.results}
    assert all(x.status == 200 and x.completion_tokens == 20 for x in r.values())
    assert r[0].stream and r[0].ttft_ms >= 64 and r[0].tpot_ms > 1.0 and r[0].cached_tokens == 0
    # The shared prefix was cached: 47 ms of prefill skipped, less up to one step (16.5 ms) waiting for
    # the step in flight when it arrived (it arrives while the first one decodes).
    assert r[1].ttft_ms < r[0].ttft_ms - 25 and r[1].cached_tokens >= 992
    assert not r[2].stream and r[2].ttft_ms is None and r[2].cached_tokens >= 992
    assert r[0].latency_ms > r[0].ttft_ms + 19 * 1.0
