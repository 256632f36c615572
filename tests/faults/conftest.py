"""Fault tests on real parts: simulated GPU backends, real Prometheus, inferlb, real Envoy.

Reuses the integration stack (tests/integration/conftest.py) and adds what faults need: a front
between inferlb and Prometheus that can turn into a 500 or garbage answerer, background traffic,
and a sampler that records what the control plane and Envoy hold over time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from inferlb.devstack import stack as stk
from inferlb.devstack.envoy_admin import envoy_hosts
from inferlb.devstack.loadgen import Result, Session, Traffic, drive, make_sessions
from tests.integration.conftest import LoopThread, Stack, start_stack, stop_stack, wait_until

__all__ = ["Background", "PrometheusFront", "Sampler", "Stack", "wait_until"]

#: Envoy-side resilience for the fault stacks: short per-try timeout, fast outlier detection.
RESILIENCE = {
    "envoy": {
        "per_try_timeout_s": 1.5,
        "retries": 2,
        "outlier_detection": {"consecutive_5xx": 3, "consecutive_gateway_failure": 2, "interval_s": 0.5,
                              "base_ejection_time_s": 2, "max_ejection_time_s": 4, "max_ejection_percent": 50},
    },
    "prometheus": {"first_round_wait_s": 5},
    # Short engine ejections, so one test's failing backend is back for the next test; no latency
    # outlier rule (as in every stack but test_engine_scenarios.py's, see tests/integration/conftest.py).
    "engine": {"filters": {"latency_outlier": False, "oom": {"base_ejection_s": 2, "max_ejection_s": 4}}},
}

GARBAGE = (
    (200, "text/html", b"<html>not Prometheus</html>"),
    (200, "application/json", b'{"status": "success"}'),
    (200, "application/json", b'{"status": "success", "data": {"resultType": "vector", "result": "nope"}}'),
    (200, "application/json", b'{"status": "success", "data": {"resultType": "vector", "result": [{"value": 1}]}}'),
    (200, "application/json", b'\xff\xfe garbage'),
)


class PrometheusFront:
    """What inferlb's ``prometheus.url`` points at.

    ``mode = "relay"``: a byte relay to the real Prometheus (kill or SIGSTOP the real one to see it
    die or hang: a refused upstream closes the client's connection, a stopped one never answers);
    ``"500"``: an aiohttp app answers every query with HTTP 500; ``"garbage"``: with one of
    :data:`GARBAGE` in turn (HTML, JSON without data, a result that is not a vector, a series
    without labels, bytes that are not UTF-8); ``"strings"``: the real Prometheus's answers with every
    sample value replaced by ``"abc"``.
    """

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.mode = "relay"
        self.upstream_port = 0
        self.queries = 0
        self._garbage = 0
        self._open: set[asyncio.StreamWriter] = set()

    def set_mode(self, mode: str) -> None:
        """Switch mode and cut every open connection (clients keep connections alive)."""
        def cut() -> None:
            self.mode = mode
            for w in list(self._open):
                w.transport.abort()
        self.loop.loop.call_soon_threadsafe(cut)

    def start(self, upstream_port: int) -> str:
        self.upstream_port = upstream_port
        return self.loop.run(self._start())

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._fake)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.fake_port = self._runner.addresses[0][1]
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _fake(self, request: web.Request) -> web.Response:
        self.queries += 1
        if self.mode == "500":
            return web.Response(status=500, text="internal error")
        if self.mode == "strings":
            return await self._strings(request)
        status, ctype, body = GARBAGE[self._garbage % len(GARBAGE)]
        self._garbage += 1
        return web.Response(status=status, body=body, content_type=ctype)

    async def _strings(self, request: web.Request) -> web.Response:
        """The real Prometheus's answer to the same query, every sample value replaced by ``"abc"``:
        valid JSON of the right shape, but not numbers (issue 15 item 3)."""
        import aiohttp

        async with aiohttp.ClientSession() as http, http.request(
                request.method, f"http://127.0.0.1:{self.upstream_port}{request.path_qs}",
                data=await request.read(), headers={"Content-Type": request.content_type}) as up:
            doc = await up.json(content_type=None)
        result = doc.get("data", {}).get("result")
        for series in result if isinstance(result, list) else []:
            if "value" in series:
                series["value"] = [series["value"][0], "abc"]
        return web.json_response(doc)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self.upstream_port if self.mode == "relay" else self.fake_port
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.transport.abort()
            return

        self._open |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()
                self._open.discard(dst)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        async def stop():
            self._server.close()
            await self._runner.cleanup()
        self.loop.run(stop())
        self.loop.close()


class Background:
    """Closed-loop traffic through Envoy from a thread while a test does something else."""

    def __init__(self, url: str, sessions: list[Session], duration_s: float, concurrency: int = 4,
                 timeout_s: float = 10.0) -> None:
        self.traffic = Traffic()
        self._thread = threading.Thread(target=lambda: asyncio.run(drive(
            f"{url}/v1/chat/completions", sessions, duration_s=duration_s, concurrency=concurrency,
            max_tokens=16, timeout_s=timeout_s, traffic=self.traffic)), daemon=True)
        self._thread.start()

    def join(self) -> list[Result]:
        self._thread.join(120)
        assert not self._thread.is_alive(), "background traffic did not finish"
        return self.traffic.results


@dataclass
class Sample:
    at: float
    metrics_ok: bool | None
    cp: dict[str, dict[str, tuple[int, str]]]   # cluster -> address -> (weight, health)
    envoy: dict[str, dict[str, tuple[int, str]]]
    why: dict[str, list[str]] = field(default_factory=dict)  # address -> reasons, for those not HEALTHY


@dataclass
class Sampler:
    """Records, every ``period_s``, the control plane's and Envoy's weights and health."""

    s: Stack
    period_s: float = 0.1
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import requests

        while not self._stop.is_set():
            try:
                doc = requests.get(f"{self.s.admin}/api/v1/weights", timeout=2).json()
                env = envoy_hosts(self.s.envoy_admin)
            except (OSError, ValueError):
                time.sleep(self.period_s)
                continue
            cp = {c["name"]: {e["address"]: (e["weight"], e["health"]) for e in c["endpoints"]}
                  for c in doc["clusters"]}
            envoy = {c: {a: (h["weight"], h["health"]) for a, h in env.get(c, {}).items()} for c in cp}
            why = {e["address"]: e["reasons"] for c in doc["clusters"] for e in c["endpoints"]
                   if e["health"] != "HEALTHY"}
            self.samples.append(Sample(time.monotonic(), doc["metrics_source"]["ok"], cp, envoy, why))
            time.sleep(self.period_s)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def sessions(seed: int = 1) -> list[Session]:
    return make_sessions(12, ["v1", "v2", None], unsessioned_share=0.3, seed=seed)


def metric_value(s: Stack, name: str) -> float | None:
    """One sample of the control plane's /metrics (exact name with labels), or None."""
    import requests

    for line in requests.get(f"{s.admin}/metrics", timeout=5).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return None


def all_healthy(s: Stack) -> bool:
    return all(e["health"] == "HEALTHY" for eps in s.weights().values() for e in eps.values())


def proc_named(s: Stack, name: str) -> stk.Proc:
    return next(p for p in s.procs if p.name == name)


@pytest.fixture(scope="package")
def front() -> Iterator[PrometheusFront]:
    f = PrometheusFront()
    yield f
    f.close()


@pytest.fixture(scope="package")
def fault_stack(tmp_path_factory, front: PrometheusFront) -> Iterator[Stack]:
    """Package-scoped: gone before other test folders run, so its control plane's process-wide
    Prometheus gauges don't mix with theirs.

    v1: two A100-class and one A10-class backend; v2: one A100-class backend; Prometheus behind
    :class:`PrometheusFront`; Envoy with a 1 s per-try timeout and fast outlier detection."""
    s = start_stack(tmp_path_factory.mktemp("faults"), [("v1", "a100"), ("v1", "a100"), ("v1", "a10"),
                                                         ("v2", "a100")],
                    config=RESILIENCE, prometheus_url=front.start)
    wait_until(lambda: all_healthy(s) and s.weights(), 20, 0.2, "every endpoint HEALTHY")
    yield s
    stop_stack(s)
