"""Traffic drivers: chat sessions with session and version headers, recorded per request.

- :func:`drive` is closed-loop (the demo and the integration tests): each worker repeatedly picks
  a session (seeded RNG) and sends an OpenAI-style request through Envoy.
- :func:`replay` is open-loop (the quality benchmark): it sends a planned trace at its arrival
  times whatever the answers, so every policy sees exactly the same requests at the same times.

Every result is kept for the summary.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class Session:
    """A client conversation: ``key`` (None = sends no session header) and ``version`` (None = no header)."""

    key: str | None
    version: str | None


@dataclass(frozen=True, slots=True)
class Result:
    """One request's outcome. ``latency_ms`` is the client-side time; ``served_by`` HOST:PORT or None.

    ``at``: wall-clock time (s) the answer (or the failure) came. ``error``: None for a 2xx, else
    ``"timeout"``, ``"connect"`` (status 0), the ``error.type`` of an OpenAI-style error body
    (e.g. ``"oom"``) or ``"http_STATUS"``. ``index``: position in the replayed trace (None for
    :func:`drive`).
    """

    session: Session
    status: int
    latency_ms: float
    served_by: str | None
    backend_version: str | None
    at: float
    error: str | None = None
    index: int | None = None


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of an open-loop trace: sent ``at_s`` seconds after the replay starts.

    ``headers``: extra request headers (e.g. ``x-sim-memory-mib``); ``max_tokens``: the body's.
    """

    at_s: float
    session: Session
    headers: Mapping[str, str] = field(default_factory=dict)
    max_tokens: int = 64


@dataclass
class Traffic:
    """Everything sent so far. ``max_lag_ms``: how late :func:`replay` sent its latest request (ms)."""

    results: list[Result] = field(default_factory=list)
    max_lag_ms: float = 0.0

    def summary(self, default_version: str) -> dict:
        """The demo summary's ``requests``, ``sessions``, ``versions`` and ``latency_ms`` parts."""
        ok = [r for r in self.results if 200 <= r.status < 300]
        by_session: dict[str, set[str]] = defaultdict(set)
        for r in ok:
            if r.session.key is not None and r.served_by:
                by_session[r.session.key].add(r.served_by)
        versions: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "correct": 0})
        for r in ok:
            want = r.session.version or default_version
            versions[want]["requests"] += 1
            versions[want]["correct"] += int(r.backend_version == want)
        lat = sorted(r.latency_ms for r in ok)
        return {
            "requests": {"total": len(self.results), "ok": len(ok), "errors": len(self.results) - len(ok)},
            "sessions": {"total": len(by_session), "sticky": sum(1 for s in by_session.values() if len(s) == 1)},
            "versions": dict(versions),
            "latency_ms": {q: (round(percentile(lat, p), 2) if lat else None)
                           for q, p in (("p50", 50), ("p95", 95), ("p99", 99))},
        }


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile ``p`` (0–100) of an ascending list (non-empty)."""
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def make_sessions(n: int, versions: list[str | None], unsessioned_share: float, seed: int) -> list[Session]:
    """``n`` sessions spread over ``versions`` (None = no version header), plus anonymous ones."""
    rng = random.Random(seed)
    out = [Session(f"session-{i:04d}", versions[i % len(versions)]) for i in range(n)]
    anon = round(n * unsessioned_share / max(1e-9, 1 - unsessioned_share))
    out += [Session(None, rng.choice(versions)) for _ in range(anon)]
    return out


def _headers(s: Session, session_header: str, version_header: str) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if s.key is not None:
        h[session_header] = s.key
    if s.version is not None:
        h[version_header] = s.version
    return h


def _chat_body(max_tokens: int) -> dict:
    return {"model": "sim-7b", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello"}]}


def error_kind(status: int, body: bytes) -> str | None:
    """None for a 2xx; else the ``error.type`` of an OpenAI-style JSON body, or ``"http_STATUS"``."""
    if 200 <= status < 300:
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    kind = err.get("type") if isinstance(err, dict) else None
    return kind if isinstance(kind, str) and kind else f"http_{status}"


async def _send(http: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]
                ) -> tuple[int, str | None, str | None, str | None]:
    """POST once: ``(status, x-served-by, x-backend-version, error kind)``; status 0 on a timeout or
    connection error (never raises for those)."""
    try:
        async with http.post(url, json=body, headers=headers) as r:
            raw = await r.read()
            return r.status, r.headers.get("x-served-by"), r.headers.get("x-backend-version"), \
                error_kind(r.status, raw)
    except TimeoutError:
        return 0, None, None, "timeout"
    except aiohttp.ClientError:
        return 0, None, None, "connect"


async def drive(url: str, sessions: list[Session], *, duration_s: float, concurrency: int, seed: int = 1,
                session_header: str = "x-session-id", version_header: str = "model-version",
                max_tokens: int = 64, timeout_s: float = 30.0, traffic: Traffic | None = None) -> Traffic:
    """Send requests to ``url`` from ``concurrency`` workers for ``duration_s`` seconds.

    Connection errors and timeouts are recorded as status 0 (never raised).
    """
    traffic = traffic or Traffic()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    body = _chat_body(max_tokens)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def worker(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            s = rng.choice(sessions)
            start = time.monotonic()
            status, served, version, error = await _send(http, url, body,
                                                         _headers(s, session_header, version_header))
            traffic.results.append(Result(s, status, (time.monotonic() - start) * 1000, served, version,
                                          time.time(), error))
            if status == 0:
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return traffic


async def replay(url: str, trace: Sequence[Planned], *, timeout_s: float = 30.0,
                 session_header: str = "x-session-id", version_header: str = "model-version",
                 traffic: Traffic | None = None) -> Traffic:
    """Send every request of ``trace`` (sorted by ``at_s``) at its time, open-loop, and wait for all.

    A request is sent at ``at_s`` whether or not earlier ones were answered; each ``Result`` has
    ``index`` = its position in ``trace``. ``timeout_s`` bounds each request (then error
    ``"timeout"``). ``traffic.max_lag_ms`` records how late the sender fell behind the plan.
    """
    traffic = traffic or Traffic()
    loop = asyncio.get_running_loop()

    async def one(http: aiohttp.ClientSession, i: int, p: Planned) -> None:
        start = time.monotonic()
        status, served, version, error = await _send(
            http, url, _chat_body(p.max_tokens), {**_headers(p.session, session_header, version_header), **p.headers})
        traffic.results.append(Result(p.session, status, (time.monotonic() - start) * 1000, served, version,
                                      time.time(), error, i))

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), connector=connector) as http:
        began = loop.time()
        tasks: list[asyncio.Task] = []
        for i, p in enumerate(trace):
            delay = began + p.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            traffic.max_lag_ms = max(traffic.max_lag_ms, (loop.time() - began - p.at_s) * 1000)
            tasks.append(asyncio.create_task(one(http, i, p)))
        await asyncio.gather(*tasks)
    return traffic
