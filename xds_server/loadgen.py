"""A closed-loop traffic driver: chat sessions with session and version headers, recorded per request.

Used by the demo and the integration tests. Each worker repeatedly picks a session (seeded RNG)
and sends an OpenAI-style request through Envoy; every result is kept for the summary.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class Session:
    """A client conversation: ``key`` (None = sends no session header) and ``version`` (None = no header)."""

    key: str | None
    version: str | None


@dataclass(frozen=True, slots=True)
class Result:
    """One request's outcome. ``latency_ms`` is the client-side time; ``served_by`` HOST:PORT or None."""

    session: Session
    status: int
    latency_ms: float
    served_by: str | None
    backend_version: str | None
    at: float


@dataclass
class Traffic:
    """Everything sent so far."""

    results: list[Result] = field(default_factory=list)

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


async def drive(url: str, sessions: list[Session], *, duration_s: float, concurrency: int, seed: int = 1,
                session_header: str = "x-session-id", version_header: str = "model-version",
                max_tokens: int = 64, timeout_s: float = 30.0, traffic: Traffic | None = None) -> Traffic:
    """Send requests to ``url`` from ``concurrency`` workers for ``duration_s`` seconds.

    Connection errors and timeouts are recorded as status 0 (never raised).
    """
    traffic = traffic or Traffic()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    body = {"model": "sim-7b", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}]}
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def worker(http: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            s = rng.choice(sessions)
            start = time.monotonic()
            try:
                async with http.post(url, json=body, headers=_headers(s, session_header, version_header)) as r:
                    await r.read()
                    status = r.status
                    served, version = r.headers.get("x-served-by"), r.headers.get("x-backend-version")
            except (aiohttp.ClientError, TimeoutError):
                status, served, version = 0, None, None
            traffic.results.append(Result(s, status, (time.monotonic() - start) * 1000, served, version,
                                          time.time()))
            if status == 0:
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return traffic
