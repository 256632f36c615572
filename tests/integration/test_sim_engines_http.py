"""Both engines through HTTP, as ``inferlb sim-backend`` processes, measured by the client.

``--engine llm --gpu-class a100``: 16 concurrent streamed requests give >= 8x the output tokens/s of
one at <= 1.3x the inter-token time (the engine's own figures: 15x, 1.04x). ``--engine job`` keeps
the seed's 50 / 95 / 220 ms at 1 / 2 / 4 concurrent and runs out of memory. ``--time-scale`` makes
every wall time that fraction of the modelled one (0.25: a 128-token answer alone takes ~0.53 s
instead of 2.1 s); the ratios measured do not change, and the job engine runs at scale 1 so the
client sees the seed's milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import requests

from inferlb.devstack import stack

pytestmark = pytest.mark.integration


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, n: int) -> list[float]:
    """Arrival times (monotonic s) of the content chunks of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": n, "stream": True}
    times: list[float] = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.monotonic())
    assert len(times) == n
    return times


async def _measure(url: str, concurrency: int, n: int) -> tuple[float, float]:
    """(output tokens/s over the whole run, mean inter-token time s) of ``concurrency`` streams."""
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        runs = await asyncio.gather(*(_stream(session, url, f"{i:04d}" * 256, n)  # 256 distinct tokens each
                                      for i in range(concurrency)))
    ended = max(t[-1] for t in runs)
    return concurrency * n / (ended - started), sum((t[-1] - t[0]) / (n - 1) for t in runs) / len(runs)


def test_llm_engine_batches_sixteen_requests_at_almost_no_cost_per_token(tmp_path):
    port = stack.free_port()
    proc = stack.start_sim(port, tmp_path, gpu_class="a100", version="v1",
                           extra=["--engine", "llm", "--time-scale", "0.25", "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        tps1, itl1 = asyncio.run(_measure(url, 1, 128))
        tps16, itl16 = asyncio.run(_measure(url, 16, 128))
        assert tps16 >= 8 * tps1, (tps1, tps16)
        assert itl16 <= 1.3 * itl1, (itl1, itl16)
    finally:
        proc.stop()


def test_job_engine_keeps_the_seed_figures_and_runs_out_of_memory(tmp_path):
    port = stack.free_port()
    proc = stack.start_sim(port, tmp_path, gpu_class="a100", version="v1",
                           extra=["--engine", "job", "--time-scale", "1.0", "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        async def together(n: int) -> list[float]:
            async def one(session: aiohttp.ClientSession) -> float:
                started = time.monotonic()
                async with session.post(f"{base}/v1/completions", json={"prompt": "x" * 64, "max_tokens": 16}) as r:
                    assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 16
                return time.monotonic() - started

            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(one(session) for _ in range(n)))  # the connections' set-up, once
                return await asyncio.gather(*(one(session) for _ in range(n)))

        # A request's pace follows the running count: on a loaded machine one of a group may start a
        # few ms late, so the others run part of their time in a smaller batch (a run measured 202 ms
        # at 4): 15 % below the seed's figure is allowed, far from the next level's.
        for n, ms in ((1, 50.0), (2, 95.0), (4, 220.0)):
            for took in asyncio.run(together(n)):
                assert 0.85 * ms <= took * 1000 <= ms + 40, (n, took)
        r = requests.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 4},
                          headers={"x-sim-memory-mib": "100000"}, timeout=5)
        assert r.status_code == 500 and r.json()["error"]["type"] == "oom"
        assert "CUDA out of memory" in r.json()["error"]["message"]
    finally:
        proc.stop()
