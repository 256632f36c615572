"""Traffic drivers: chat sessions with session and version headers, recorded per request.

- :func:`drive` is closed-loop (the demo and the integration tests): each worker repeatedly picks
  a session (seeded RNG) and sends a chat completion through Envoy with the official ``openai``
  client (``AsyncOpenAI``, no retries), streamed (with the usage chunk) for a ``stream_share`` of
  the requests.
- :func:`replay` is open-loop (the quality benchmark): it sends a planned trace at its arrival
  times whatever the answers, so every policy sees exactly the same requests at the same times.
  It speaks the same OpenAI protocol (Server-Sent Events when streamed) over plain aiohttp, whose
  per-chunk cost is a fraction of the ``openai`` client's, so the client's own CPU use disturbs the
  measurement less on a small machine.

Every result is kept for the summary, with time to first token (TTFT) and time per output token
(TPOT) for streamed requests.
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
    :func:`drive`). ``stream``: sent with ``"stream": true``; then ``ttft_ms`` = time to the first
    content chunk and ``tpot_ms`` = (last - first content chunk) / (chunks - 1), ms (None when it
    does not apply). Token counts come from the answer's ``usage`` (None when absent).
    """

    session: Session
    status: int
    latency_ms: float
    served_by: str | None
    backend_version: str | None
    at: float
    error: str | None = None
    index: int | None = None
    stream: bool = False
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of an open-loop trace: sent ``at_s`` seconds after the replay starts.

    ``headers``: extra request headers (e.g. ``x-sim-memory-mib``); ``max_tokens``: the body's.
    ``messages``: the chat messages (None = one short user message); ``stream``: ask for SSE chunks
    (with ``stream_options.include_usage``).
    """

    at_s: float
    session: Session
    headers: Mapping[str, str] = field(default_factory=dict)
    max_tokens: int = 64
    messages: Sequence[Mapping[str, str]] | None = None
    stream: bool = False


@dataclass
class Traffic:
    """Everything sent so far. ``max_lag_ms``: how late :func:`replay` sent its latest request (ms).
    ``in_flight``: requests :func:`drive` has sent and not yet seen answered."""

    results: list[Result] = field(default_factory=list)
    max_lag_ms: float = 0.0
    in_flight: int = 0

    def summary(self, default_version: str) -> dict:
        """The demo summary's ``requests``, ``sessions``, ``versions``, ``latency_ms`` (end to end) and
        ``ttft_ms`` (streamed requests) parts."""
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
        ttft = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
        return {
            "requests": {"total": len(self.results), "ok": len(ok), "errors": len(self.results) - len(ok),
                         "streamed": sum(1 for r in ok if r.stream)},
            "sessions": {"total": len(by_session), "sticky": sum(1 for s in by_session.values() if len(s) == 1)},
            "versions": dict(versions),
            "latency_ms": {q: (round(percentile(lat, p), 2) if lat else None)
                           for q, p in (("p50", 50), ("p95", 95), ("p99", 99))},
            "ttft_ms": {q: (round(percentile(ttft, p), 2) if ttft else None)
                        for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
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


DEMO_SYSTEM_PROMPT = ("You are the inferlb demo assistant. Answer in one short sentence, politely, and never "
                      "mention that you are simulated. ") * 4


#: The ``model`` every generated request names: the simulator's served model name (``sim --model-name``).
MODEL_NAME = "sim-7b"


def _chat_body(max_tokens: int, messages: Sequence[Mapping[str, str]] | None = None, stream: bool = False) -> dict:
    body: dict = {"model": MODEL_NAME, "max_tokens": max_tokens,
                  "messages": list(messages) if messages is not None else [{"role": "user", "content": "hello"}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def error_kind(status: int, body: bytes) -> str | None:
    """None for a 2xx; else the ``error.code`` of an OpenAI error object (inferlb's and Envoy's stable
    codes: ``overloaded``, ``no_healthy_upstream`` ...), else its ``error.type`` (the simulator's
    ``oom``), else ``"http_STATUS"``."""
    if 200 <= status < 300:
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        for kind in (err.get("code"), err.get("type")):
            if isinstance(kind, str) and kind:
                return kind
    return f"http_{status}"


_Outcome = tuple[int, str | None, str | None, str | None, dict]


def _usage_fields(usage: Mapping | None) -> dict:
    if not isinstance(usage, Mapping):
        return {}
    details = usage.get("prompt_tokens_details")
    return {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens") if isinstance(details, Mapping) else None}


def _stream_times(start: float, token_times: list[float]) -> dict:
    if not token_times:
        return {}
    out = {"ttft_ms": (token_times[0] - start) * 1000}
    if len(token_times) > 1:
        out["tpot_ms"] = (token_times[-1] - token_times[0]) * 1000 / (len(token_times) - 1)
    return out


def _has_token(chunk: Mapping) -> bool:
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        delta = choice.get("delta")
        if (isinstance(delta, Mapping) and delta.get("content")) or choice.get("text"):
            return True
    return False


async def _send(http: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> _Outcome:
    """POST once: ``(status, x-served-by, x-backend-version, error kind, extras)``; status 0 on a
    timeout or connection error (never raises for those). ``extras``: :class:`Result` fields (TTFT,
    TPOT, token counts)."""
    start = time.monotonic()
    try:
        async with http.post(url, json=body, headers=headers) as r:
            served, version = r.headers.get("x-served-by"), r.headers.get("x-backend-version")
            if not body.get("stream") or not 200 <= r.status < 300:
                raw = await r.read()
                extras: dict = {}
                if 200 <= r.status < 300:
                    try:
                        extras = _usage_fields(json.loads(raw).get("usage"))
                    except (ValueError, AttributeError):
                        pass
                return r.status, served, version, error_kind(r.status, raw), extras
            token_times: list[float] = []
            usage = None
            buf = b""
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    try:
                        chunk = json.loads(event[6:])
                    except ValueError:
                        continue
                    if _has_token(chunk):
                        token_times.append(time.monotonic())
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            return r.status, served, version, None, {**_usage_fields(usage), **_stream_times(start, token_times)}
    except TimeoutError:
        return 0, None, None, "timeout", {}
    except aiohttp.ClientError:
        return 0, None, None, "connect", {}


async def _send_openai(client, body: dict, headers: dict[str, str]) -> _Outcome:
    """One chat completion with the ``openai`` client (``client``: an ``openai.AsyncOpenAI``), streamed
    when ``body["stream"]``; same outcome shape as :func:`_send`, never raises for HTTP errors,
    timeouts or connection errors."""
    import openai

    start = time.monotonic()
    kwargs = {k: v for k, v in body.items() if k in ("model", "messages", "max_tokens", "stream", "stream_options")}
    try:
        if body.get("stream"):
            async with client.chat.completions.with_streaming_response.create(**kwargs, extra_headers=headers) as r:
                token_times: list[float] = []
                usage = None
                async for chunk in await r.parse():
                    if any(c.delta.content for c in chunk.choices):
                        token_times.append(time.monotonic())
                    if chunk.usage is not None:
                        usage = chunk.usage.model_dump()
                return r.status_code, r.headers.get("x-served-by"), r.headers.get("x-backend-version"), None, \
                    {**_usage_fields(usage), **_stream_times(start, token_times)}
        raw = await client.chat.completions.with_raw_response.create(**kwargs, extra_headers=headers)
        done = raw.parse()
        usage = done.usage.model_dump() if done.usage is not None else None
        return raw.status_code, raw.headers.get("x-served-by"), raw.headers.get("x-backend-version"), None, \
            _usage_fields(usage)
    except openai.APIStatusError as err:
        kind = err.type if isinstance(getattr(err, "type", None), str) and err.type else f"http_{err.status_code}"
        return err.status_code, err.response.headers.get("x-served-by"), \
            err.response.headers.get("x-backend-version"), kind, {}
    except openai.APITimeoutError:
        return 0, None, None, "timeout", {}
    except (openai.APIConnectionError, openai.APIResponseValidationError, ValueError):
        return 0, None, None, "connect", {}


async def drive(url: str, sessions: list[Session], *, duration_s: float, concurrency: int, seed: int = 1,
                session_header: str = "x-session-id", version_header: str = "model-version",
                max_tokens: int = 64, timeout_s: float = 30.0, traffic: Traffic | None = None,
                stream_share: float = 0.0, system_prompt: str | None = None, rate: float | None = None,
                gate: asyncio.Event | None = None) -> Traffic:
    """Send chat completions to ``url`` (``.../v1/chat/completions``) from ``concurrency`` workers
    for ``duration_s`` seconds, with the ``openai`` client.

    ``stream_share`` (0-1) of the requests are streamed; ``system_prompt`` (optional) starts every
    conversation (a shared prefix the backends' prefix cache keeps). ``rate``: at most this many
    requests per second over all workers, evenly spaced (None: each worker sends as soon as its
    last answer came). ``gate``: while it is cleared no new request starts (the ones in flight
    finish). Connection errors and timeouts are recorded as status 0 (never raised).
    """
    import openai

    traffic = traffic or Traffic()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    base_url = url.rsplit("/chat/completions", 1)[0]
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": "hello"}]

    next_at = [time.monotonic()]

    async def paced() -> None:
        if gate is not None:
            await gate.wait()
        if rate:
            now = time.monotonic()
            slot = max(next_at[0], now)
            next_at[0] = slot + 1 / rate
            await asyncio.sleep(slot - now)

    async def worker(client) -> None:
        while time.monotonic() < deadline:
            await paced()
            if gate is not None and not gate.is_set():
                continue
            s = rng.choice(sessions)
            stream = rng.random() < stream_share
            start = time.monotonic()
            headers = _headers(s, session_header, version_header)
            del headers["content-type"]
            traffic.in_flight += 1
            try:
                status, served, version, error, extras = await _send_openai(
                    client, _chat_body(max_tokens, messages, stream), headers)
            finally:
                traffic.in_flight -= 1
            traffic.results.append(Result(s, status, (time.monotonic() - start) * 1000, served, version,
                                          time.time(), error, stream=stream, **extras))
            if status == 0:
                await asyncio.sleep(0.05)

    async with openai.AsyncOpenAI(base_url=base_url, api_key="inferlb-demo", max_retries=0,
                                  timeout=timeout_s) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
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
        status, served, version, error, extras = await _send(
            http, url, _chat_body(p.max_tokens, p.messages, p.stream),
            {**_headers(p.session, session_header, version_header), **p.headers})
        traffic.results.append(Result(p.session, status, (time.monotonic() - start) * 1000, served, version,
                                      time.time(), error, i, stream=p.stream, **extras))

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
