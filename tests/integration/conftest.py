"""Real stacks for integration tests: simulated backends, real Prometheus, inferlb, real Envoy.

inferlb runs in a thread of the test process (its own event loop), so tests can reach its parts
(stop the picker, publish a snapshot); everything else is a plain child process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from inferlb.devstack import stack
from inferlb.devstack.loadgen import Session, Traffic, drive
from inferlb.serve import InferLB
from xds_server.config import Config, load_config
from xds_server.resources.bootstrap import render_bootstrap

#: ``--time-scale`` of the tests' simulated backends. ``llm`` engines (the default) run 25x faster than
#: the GPU they model, so a short request (16 output tokens alone on an A100: 16 steps of 16.5 ms)
#: takes ~10 ms of wall time; ``job`` engines 5x, so their seed request (50 ms) takes 10 ms too.
LLM_TIME_SCALE = "0.04"
JOB_TIME_SCALE = "0.2"


def is_job(args: list[str]) -> bool:
    """True for a backend started with ``args`` that runs the ``job`` engine (a per-request server)."""
    return any(a == "--engine" and b == "job" for a, b in zip(args, args[1:], strict=False))


def sim_time_scale(args: list[str]) -> list[str]:
    """``--time-scale`` for a backend started with ``args`` (job engines: :data:`JOB_TIME_SCALE`)."""
    return ["--time-scale", JOB_TIME_SCALE if is_job(args) else LLM_TIME_SCALE]


def wait_until(check: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    """Call ``check`` until it returns a truthy value; return it. Fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last value: {last!r}")


class LoopThread:
    """An asyncio loop in a daemon thread; ``run(coro)`` runs a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Cancel what still runs there (the servers' stream tasks), then stop and close the loop."""
        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if self.loop.is_running():
            self.run(cancel_the_rest(), timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        self.loop.close()


@dataclass
class Backend:
    version: str
    gpu_class: str
    port: int
    proc: stack.Proc | None  # None: not started yet (see Stack.start_backend)
    args: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def fault(self, **faults) -> None:
        requests.post(f"http://{self.address}/sim/fault", json=faults, timeout=5).raise_for_status()


@dataclass
class Stack:
    workdir: Path
    cfg: Config
    app: InferLB
    loop: LoopThread
    backends: list[Backend]
    envoy: stack.Proc
    envoy_admin: str
    listener: str
    procs: list[stack.Proc] = field(default_factory=list)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.app.admin_port}"

    def weights(self) -> dict[str, dict[str, dict]]:
        """``{cluster: {address: endpoint document}}`` from the control plane's admin API."""
        doc = requests.get(f"{self.admin}/api/v1/weights", timeout=5).json()
        return {c["name"]: {e["address"]: e for e in c["endpoints"]} for c in doc["clusters"]}

    def start_backend(self, b: Backend) -> None:
        """Start a backend the layout deferred (a node joining later)."""
        b.proc = stack.start_sim(b.port, self.workdir, gpu_class=b.gpu_class, version=b.version, extra=b.args)
        self.procs.append(b.proc)

    def send(self, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions",
             timeout: float = 10.0) -> requests.Response:
        return requests.post(f"{self.listener}{path}", json={"max_tokens": 16, "messages": []},
                             headers=headers or {}, timeout=timeout)


class Background:
    """Traffic through Envoy from a thread while a test watches something else."""

    def __init__(self, s: Stack, sessions: list[Session], duration_s: float, concurrency: int = 4) -> None:
        self.traffic = Traffic()
        self._thread = threading.Thread(target=lambda: asyncio.run(drive(
            f"{s.listener}/v1/chat/completions", sessions, duration_s=duration_s, concurrency=concurrency,
            max_tokens=16, traffic=self.traffic)), daemon=True)
        self._thread.start()

    def join(self) -> Traffic:
        self._thread.join(90)
        return self.traffic


def backend_config(backends: list[Backend], prometheus_url: str, listener_port: int, **engine) -> dict:
    versions: dict[str, list[dict]] = {}
    for b in backends:
        versions.setdefault(b.version, []).append({"address": b.address, "gpu_class": b.gpu_class})
    return {
        "listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "envoy": {"listener": f"127.0.0.1:{listener_port}"},
        "prometheus": {"url": prometheus_url, "window_s": 5, "interval_s": 0.5, "timeout_s": 1},
        # latency_outlier off: on a loaded 2-core CI machine one stalled sim request makes its
        # endpoint a latency outlier, and the tests of other rules (stale, drain, picks) found it
        # ejected. Its own tests (test_engine_scenarios.py) turn it on.
        "engine": {"stale_after_s": 6, "hysteresis": 0.05, "filters": {"latency_outlier": False}, **engine},
        "services": [{"name": "chat", "default_version": "v1",
                      "versions": [{"name": v, "endpoints": eps} for v, eps in versions.items()]}],
    }


def merge(base, extra):
    """``extra`` merged into ``base``: dicts key by key, lists item by item (so one endpoint of a
    version can be changed in place), anything else replaced."""
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in extra.items()}}
    if isinstance(base, list) and isinstance(extra, list):
        return [merge(b, e) for b, e in zip(base, extra, strict=False)] + base[len(extra):] + extra[len(base):]
    return extra


def start_stack(workdir: Path, layout: list[tuple[str, str]], sim_args: list[str] | None = None, *,
                backend_args: dict[int, list[str]] | None = None, config: dict | None = None,
                deferred: Collection[int] = (), prometheus_url: Callable[[int], str] | None = None,
                port_offsets: Collection[int] = ()) -> Stack:
    """Backends per ``layout`` [(version, gpu_class)], Prometheus (1 s scrapes), inferlb, Envoy.

    ``sim_args``: for every backend; ``backend_args``: more per layout index; ``config``: merged into the
    inferlb config (dicts by key, lists by position: see :func:`merge`); ``deferred``: layout indexes
    configured but not started (``Stack.start_backend``); ``prometheus_url``: Prometheus's port -> the
    URL inferlb queries (a fault-injecting front, say); ``port_offsets``: each backend's port ``p`` has
    ``p + o`` free and reserved too (a second port it binds: see :func:`inferlb.devstack.stack.free_port`).
    """
    procs: list[stack.Proc] = []
    loop = LoopThread()
    try:
        backends = []
        for i, (version, gpu) in enumerate(layout):
            port = stack.free_port(port_offsets)
            args = [*(sim_args or []), *(backend_args or {}).get(i, [])]
            args = [*sim_time_scale(args), *args]
            proc = None if i in deferred else stack.start_sim(port, workdir, gpu_class=gpu, version=version,
                                                              extra=args)
            if proc is not None:
                procs.append(proc)
            backends.append(Backend(version, gpu, port, proc, args))
        prom_port = stack.free_port()
        procs.append(stack.start_prometheus([b.address for b in backends], workdir, prom_port, 1.0))
        listener_port, admin_port = stack.free_port(), stack.free_port()
        cfg_path = workdir / "inferlb.yaml"
        url = prometheus_url(prom_port) if prometheus_url else f"http://127.0.0.1:{prom_port}"
        cfg_dict = backend_config(backends, url, listener_port)
        # A version of job backends is one of per-request servers, as its operator would say (the sim
        # speaks vLLM's metric names, and the vllm preset means a preallocated KV-cache pool).
        for v in cfg_dict["services"][0]["versions"]:
            if all(is_job(b.args) for b in backends if b.version == v["name"]):
                v["gpu_memory"] = "per_request"
        cfg_dict["history"] = {"path": str(workdir / "history.sqlite3"), "keyframe_s": 5}
        cfg_path.write_text(yaml.safe_dump(merge(cfg_dict, config or {})))
        cfg = load_config(cfg_path)
        app = InferLB(cfg, cfg_path)
        loop.run(app.start())
        wait_until(lambda: app.control.ready.is_set(), 10, what="first snapshot")
        envoy = stack.start_envoy(render_bootstrap(xds_address=f"127.0.0.1:{app.xds_port}", node_id="test-envoy",
                                                   admin_port=admin_port), workdir, admin_port)
        procs.append(envoy)
        envoy_admin = f"http://127.0.0.1:{admin_port}"
        stack.wait_http(f"{envoy_admin}/ready", envoy, timeout=20)
        return Stack(workdir, cfg, app, loop, backends, envoy, envoy_admin,
                     f"http://127.0.0.1:{listener_port}", procs)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        loop.close()
        raise


def stop_stack(s: Stack) -> None:
    s.envoy.stop()
    try:
        s.loop.run(s.app.stop(grace_s=0.2))
    finally:
        s.loop.close()
        for p in reversed(s.procs):
            p.stop()


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory) -> Iterator[Stack]:
    """v1: two A100-class and one A10-class backend; v2: one A100-class backend."""
    s = start_stack(tmp_path_factory.mktemp("stack"), [("v1", "a100"), ("v1", "a100"), ("v1", "a10"),
                                                        ("v2", "a100")])
    yield s
    stop_stack(s)
