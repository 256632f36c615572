"""One simulated inference node: the real-time shell around one engine.

The physics lives in :mod:`sim.engines` (an ``llm`` or a ``job`` engine, a pure state machine in
its own seconds); this module only drives it on the wall clock and connects it to the HTTP
handlers (:mod:`sim.server`): it turns a parsed request into an
:class:`~sim.engines.api.EngineRequest` (session history, output length, the long-tail draw),
submits it, and hands the engine's events to the request's handler as they come due.

**Clock.** Engine time = (event-loop time - the node's start) / ``time_scale``: a node at
``--time-scale 0.2`` runs its engine five times faster than the hardware it models, and every
duration it reports (metrics, ``/sim/spans``) is wall-clock, i.e. compressed. One driver task
sleeps until the engine's next event (:meth:`~sim.engines.api.Engine.next_event_s`), or at most
:data:`TICK_S` while requests are streaming, then advances the engine to *now* and dispatches what
came due. A wake-up that comes late because the host's CPU was busy (the simulated nodes share
their machine with the load balancer under test; a GPU does not) delivers its tokens late but
does not shift the engine's schedule: the node runs at the model's speed, not the host's.

Faults (:mod:`sim.faults`): ``hang`` holds requests before they reach the engine; ``slow_factor``
is the engine's (its steps, or its new requests, take longer); ``long_tail`` draws, per request,
whether it runs :data:`LONG_TAIL_FACTOR` times slower (``EngineRequest.slowdown``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sim.config import BackendConfig
from sim.engines.api import (
    FAIL_OOM,
    Engine,
    EngineEvent,
    EngineRequest,
    EngineStats,
    Failed,
    Finished,
    FirstToken,
    Tokens,
)
from sim.engines.hardware import GPU_CLASSES
from sim.engines.job import JobEngine
from sim.engines.llm import LlmEngine
from sim.faults import FaultState
from sim.kv_publish import KvEventPublisher
from sim.metrics import GaugeSnapshot, SimMetrics
from sim.protocol import InferenceRequest
from sim.tokens import session_tokens

#: Longest wall-clock time between two deliveries of a streaming request's tokens, s.
TICK_S = 0.004

#: Multiplier of a long-tail request's time (the ``long_tail`` fault).
LONG_TAIL_FACTOR = 10.0

#: Requests whose time on the node :attr:`SimNode.spans` keeps (the most recent ones).
SPANS_KEPT = 200_000

#: Words the simulated replies are made of (one token each).
_WORDS = ("Simulated", "reply", "from")


class EngineRefused(Exception):
    """The engine refused or failed the request before its first token (``reason``: the engine's)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class NodeClosing(Exception):
    """The node is shutting down; the request was not served."""


def make_engine(cfg: BackendConfig) -> LlmEngine | JobEngine:
    """The engine ``cfg`` asks for, streaming (the node reports tokens as they come)."""
    if cfg.engine == "job":
        return JobEngine(cfg.gpu_class, max_concurrency=cfg.max_concurrency,
                         gpu_memory_mib=cfg.gpu_memory_mib, weights_mib=cfg.weights_mib,
                         kv_mib_per_token=cfg.kv_mib_per_token, stream=True)
    return LlmEngine(cfg.gpu_class, cfg.model, max_num_seqs=cfg.max_concurrency,
                     max_num_batched_tokens=cfg.max_num_batched_tokens, gpu_memory_mib=cfg.gpu_memory_mib,
                     prefix_caching=cfg.prefix_caching, stream=True, block_size=cfg.block_size,
                     kv_events=cfg.kv_events_endpoint is not None)


def output_length(rng: random.Random, max_tokens: int | None, default_max: int) -> int:
    """Tokens a request generates: ``max_tokens`` when given (finish reason ``length``), else a
    seeded draw, uniform in 1..``default_max``."""
    if max_tokens is not None:
        return max_tokens
    return rng.randint(1, default_max)


def gpu_uuid_for(hostname: str, served_by: str, seed: int | None) -> str:
    """A stable ``GPU-...`` UUID per (host, address, seed), like DCGM's ``UUID`` label."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{hostname}/{served_by}/{seed}"))


@dataclass
class Job:
    """One request inside the node: what was submitted and how it went.

    ``tokens``: every prompt token the engine sees (session history first, if any);
    ``output_tokens``: tokens it generates. Times in wall seconds from its arrival.
    """

    req: InferenceRequest
    request_id: str
    tokens: tuple[int, ...]
    output_tokens: int
    long_tail: bool
    history_tokens: int = 0
    session_hit: bool | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    queue_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float = 0.0

    @property
    def finish_reason(self) -> str:
        """``length`` when ``max_tokens`` ended the output, else ``stop``."""
        return "length" if self.req.max_tokens_given else "stop"

    def token_text(self, i: int) -> str:
        """Text of output token ``i`` (0-based)."""
        return _WORDS[i % len(_WORDS)] + " "


@dataclass(frozen=True)
class Completion:
    """Outcome of a served request; times in seconds, memory in MiB, tokens."""

    request_id: str
    text: str
    queue_s: float
    ttft_s: float
    e2e_s: float
    memory_mib: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    session_hit: bool | None
    long_tail: bool
    preemptions: int


class SimNode:
    """One simulated backend: an engine on the wall clock, faults, metrics. Use from one event loop."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.gpu = GPU_CLASSES[cfg.gpu_class]
        self.engine: Engine = make_engine(cfg)
        self.rng = random.Random(cfg.seed)
        self.faults = FaultState(cfg.long_tail)
        self.served_by = f"{cfg.host}:{cfg.port}"
        self.metrics = SimMetrics(
            model_name=cfg.model_name,
            gpu_model_name=self.gpu.dcgm_model_name,
            gpu_uuid=gpu_uuid_for(cfg.hostname, self.served_by, cfg.seed),
            hostname=cfg.hostname,
            legacy_kv_name=cfg.legacy_metrics,
        )
        self.counters = {"requests": 0, "success": 0, "oom": 0, "refused": 0, "bad_requests": 0,
                         "cancelled": 0, "session_hits": 0, "session_misses": 0, "long_tail": 0}
        self.hung = 0  # requests currently held by the hang fault
        self.spans: deque[tuple[float, float]] = deque(maxlen=SPANS_KEPT)
        """``(arrived, left)`` wall-clock times (s, ``time.time()``) of every request that held the node:
        from its arrival (a hang fault's wait included) to its end, however it ended; a request refused
        at once (out of memory, too long, shutting down) has none. Oldest first; the last
        :data:`SPANS_KEPT`."""
        self._seq = 0
        self._origin: float | None = None  # loop time of engine time 0
        self._pending: dict[str, asyncio.Queue[EngineEvent]] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._slow = 1.0
        self.kv_publisher: KvEventPublisher | None = None
        """The KV-cache events' publisher (``cfg.kv_events_endpoint``; :meth:`open_kv_events`)."""

    @property
    def max_concurrency(self) -> int:
        """Requests the engine runs at once (llm: ``max_num_seqs``)."""
        spec = self.engine.spec  # type: ignore[attr-defined]
        return spec.max_concurrency if self.cfg.engine == "job" else spec.max_num_seqs

    def bind(self, served_by: str) -> None:
        """Record the address actually listened on (``HOST:PORT``), e.g. after binding port 0."""
        self.served_by = served_by
        self.metrics.set_gpu_uuid(gpu_uuid_for(self.cfg.hostname, served_by, self.cfg.seed))

    # --- the clock ------------------------------------------------------------------------------

    def _engine_now(self) -> float:
        loop = asyncio.get_running_loop()
        if self._origin is None:
            self._origin = loop.time()
        return (loop.time() - self._origin) / self.cfg.time_scale

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        """Advance the engine at its next event (or every :data:`TICK_S` while requests stream)."""
        scale = self.cfg.time_scale
        while True:
            now = self._engine_now()
            self._dispatch(self.engine.advance(now))
            nxt = self.engine.next_event_s()
            if nxt is None and not self._pending:
                self._driver = None
                return
            wait = TICK_S if self._pending else None
            if nxt is not None:
                due = max(0.0, (nxt - now) * scale)
                wait = due if wait is None else min(wait, due)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for ev in events:
            q = self._pending.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.engine.drain_kv_events(), time.time())

    def open_kv_events(self) -> None:
        """Bind the KV-cache events' publisher at ``cfg.kv_events_endpoint`` (none: nothing happens).

        Raises:
            ImportError: ``pyzmq`` or ``msgpack`` is not installed.
            zmq.ZMQError: the endpoint cannot be bound.
        """
        if self.cfg.kv_events_endpoint is not None and self.kv_publisher is None:
            self.kv_publisher = KvEventPublisher(self.cfg.kv_events_endpoint, opaque=self.cfg.kv_events_opaque)

    def close_kv_events(self) -> None:
        """Close the KV-cache events' publisher, if open."""
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None

    def apply_faults(self, patch: dict[str, Any]) -> None:
        """Apply a fault patch (:func:`sim.faults.parse_fault_patch`); a new ``slow_factor`` reaches
        the engine at once (its steps, or its new requests, take that much longer from now)."""
        self.faults.apply(patch)
        if self.faults.slow_factor != self._slow:
            self._slow = self.faults.slow_factor
            self.engine.set_slow_factor(self._slow, self._engine_now())
            self._wake.set()

    # --- the request's life ----------------------------------------------------------------------

    def new_job(self, req: InferenceRequest) -> Job:
        """Make the job of ``req``: its id, prompt tokens (session history first), output length and
        long-tail draw (one seeded draw each, in that order)."""
        self._seq += 1
        self.counters["requests"] += 1
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        history: list[int] = []
        if req.session_key is not None and self.cfg.session_history_tokens:
            history = session_tokens(req.session_key, self.cfg.session_history_tokens)
        tokens = (*history, *req.tokens) if history else (req.tokens or (0,) * max(1, req.prompt_tokens))
        out = output_length(self.rng, req.max_tokens if req.max_tokens_given else None, self.cfg.default_max_tokens)
        long_tail = self.rng.random() < self.faults.long_tail
        if long_tail:
            self.counters["long_tail"] += 1
        return Job(req=req, request_id=f"{prefix}-{self.metrics.gpu_uuid[4:12]}-{self._seq}", tokens=tokens,
                   output_tokens=out, long_tail=long_tail, history_tokens=len(history),
                   session_hit=None if not history else False)

    async def serve(self, req: InferenceRequest) -> Completion:
        """Serve ``req`` whole (non-streaming): see :meth:`generate`."""
        job = self.new_job(req)
        async for _ in self.generate(job):
            pass
        return self.completion(job)

    def completion(self, job: Job) -> Completion:
        """The outcome of a finished ``job``."""
        text = "".join(job.token_text(i) for i in range(job.output_tokens)).rstrip()
        return Completion(
            request_id=job.request_id, text=text, queue_s=job.queue_s, ttft_s=job.first_token_s or 0.0,
            e2e_s=job.finished_s, memory_mib=job.req.memory_mib or 0.0, prompt_tokens=job.req.prompt_tokens,
            completion_tokens=job.output_tokens, cached_tokens=max(0, job.cached_tokens - job.history_tokens),
            finish_reason=job.finish_reason, session_hit=job.session_hit, long_tail=job.long_tail,
            preemptions=job.preemptions)

    async def generate(self, job: Job) -> AsyncIterator[int]:
        """Run ``job``; yields the number of new output tokens each time some come out (the first
        yield is the first token, at TTFT). Raises :class:`EngineRefused` (before any token: out of
        memory, prompt too long) or :class:`NodeClosing` on shutdown. When the consumer stops early
        (a client gone) the engine drops the request."""
        arrived = time.time()
        self.hung += 1
        try:
            await self.faults.wait_while(lambda: self.faults.hang)
        finally:
            self.hung -= 1
        if self.faults.closing:
            raise NodeClosing("backend is shutting down")
        scale = self.cfg.time_scale
        now = self._engine_now()
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._pending[job.request_id] = queue
        self.engine.submit(EngineRequest(job.request_id, job.tokens, job.output_tokens, now,
                                         job.req.memory_mib, LONG_TAIL_FACTOR if job.long_tail else 1.0), now)
        self._ensure_driver()
        finished = False
        held = True
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, FirstToken):
                    job.first_token_s = (ev.time_s - now) * scale
                    job.cached_tokens = ev.cached_tokens
                    self.metrics.observe_ttft(job.first_token_s)
                    if job.session_hit is not None:
                        job.session_hit = ev.cached_tokens > 0
                        self.counters["session_hits" if job.session_hit else "session_misses"] += 1
                        self.metrics.observe_session(job.session_hit)
                    yield 1
                elif isinstance(ev, Tokens):
                    self.metrics.observe_inter_token(ev.itl_s * scale, ev.count)
                    yield ev.count
                elif isinstance(ev, Finished):
                    finished = True
                    self._finish(job, ev, now)
                    return
                elif isinstance(ev, Failed):
                    finished = True
                    held = False
                    self.counters["oom" if ev.reason == FAIL_OOM else "refused"] += 1
                    if ev.reason == FAIL_OOM:
                        self.metrics.observe_oom()
                    raise EngineRefused(ev.reason, ev.detail)
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["cancelled"] += 1
            raise
        finally:
            self._pending.pop(job.request_id, None)
            if not finished:
                self.engine.cancel(job.request_id, self._engine_now())
                self._wake.set()
            if held:
                self.spans.append((arrived, time.time()))

    def _finish(self, job: Job, ev: Finished, submitted: float) -> None:
        scale = self.cfg.time_scale
        job.finished_s = (ev.time_s - submitted) * scale
        job.queue_s = ev.queue_s * scale
        job.preemptions = ev.preemptions
        self.counters["success"] += 1
        ttft = job.first_token_s or 0.0
        tpot = (job.finished_s - ttft) / (job.output_tokens - 1) if job.output_tokens > 1 else None
        self.metrics.observe_finished(
            e2e_s=job.finished_s, queue_s=job.queue_s, prompt_tokens=job.req.prompt_tokens,
            generation_tokens=job.output_tokens, finished_reason=job.finish_reason, tpot_s=tpot,
            prefill_s=max(0.0, ttft - job.queue_s))

    # --- views -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's gauges and counters (after advancing it to now when a loop runs)."""
        try:
            self._dispatch(self.engine.advance(self._engine_now()))
        except RuntimeError:  # no running event loop: the engine as it stands
            pass
        return self.engine.stats()

    def gauges(self) -> GaugeSnapshot:
        """Current gauge values for the exposition; also brings the prefix and preemption counters
        up to the engine's."""
        s = self.stats()
        self.metrics.sync_engine_counters(s.prefix_queries, s.prefix_hits, s.preemptions)
        return GaugeSnapshot(running=s.running, waiting=s.waiting, kv_usage=s.kv_usage,
                             gpu_util_percent=self._gpu_util(s), fb_used_mib=s.memory_used_mib,
                             fb_free_mib=s.memory_free_mib)

    def _gpu_util(self, s: EngineStats) -> float:
        """DCGM-style utilisation, percent: an llm engine computes whenever anything runs (100);
        a job server in proportion to its running slots."""
        if s.running <= 0:
            return 0.0
        if self.cfg.engine == "llm":
            return 100.0
        return min(100.0, 100.0 * s.running / self.max_concurrency)

    def spans_since(self, since: float) -> list[tuple[float, float]]:
        """The :attr:`spans` of the requests that left at or after ``since`` (wall s), oldest first."""
        return [s for s in self.spans if s[1] >= since]

    def state(self) -> dict[str, Any]:
        """JSON-able view of the node for ``GET /sim/state`` (memory in MiB, kv_usage 0-1)."""
        s = self.stats()
        spec = self.engine.spec  # type: ignore[attr-defined]
        state: dict[str, Any] = {
            "served_by": self.served_by,
            "version": self.cfg.version,
            "model_name": self.cfg.model_name,
            "engine": self.cfg.engine,
            "gpu_class": self.gpu.key,
            "gpu_model_name": self.gpu.dcgm_model_name,
            "time_scale": self.cfg.time_scale,
            "max_concurrency": self.max_concurrency,
            "running": s.running,
            "waiting": s.waiting,
            "hung": self.hung,
            "gpu_util_percent": self._gpu_util(s),
            "memory": {"total_mib": s.memory_total_mib, "used_mib": s.memory_used_mib,
                       "free_mib": s.memory_free_mib, "kv_usage": s.kv_usage},
            "faults": self.faults.as_dict(),
            "counters": {**self.counters, "preemptions": s.preemptions, "prefix_queried_tokens": s.prefix_queries,
                         "prefix_hit_tokens": s.prefix_hits},
        }
        if isinstance(self.engine, LlmEngine):
            state["model"] = spec.model.key
            state["kv_cache"] = {"block_size": spec.block_size, "blocks": s.kv_blocks_total,
                                 "blocks_used": s.kv_blocks_used, "cached_blocks": self.engine.cached_blocks,
                                 "evicted_blocks": self.engine.evicted_blocks,
                                 "max_num_batched_tokens": spec.max_num_batched_tokens,
                                 "max_model_len": spec.max_model_len}
        return state
