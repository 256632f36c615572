"""One simulated inference node: admission, FIFO queue, prefill and decode, KV memory, the prefix
cache, preemption, faults, metrics.

Glues the pure :mod:`sim.model` to asyncio time. HTTP lives in :mod:`sim.server`.

A request's life: (explicit ``x-sim-memory-mib`` reservation, refused at once if it does not fit)
-> FIFO queue for a running slot -> KV admission (prefix-cache lookup; memory for the uncached
prompt blocks, plus the whole output in ``oom_mode: error``) -> prefill of the uncached tokens
(the first token comes out at its end) -> decode, one step per token at the speed of the running
batch. Tokens come out in ticks of at least :data:`TICK_S` of wall time (several tokens per tick
when steps are shorter), so a time-compressed node does not wake up for every token.

Times follow a schedule, as a GPU's do: the end of a request's prefill and of each decode tick is
due at a point in time (the previous one plus the model's duration), and the node sleeps until that
point (:func:`sleep_until`). A wake-up that comes late because the host's CPU was busy (the
simulated nodes share their machine with the load balancer under test, a real GPU does not) is
made up at the next tick instead of delaying every later token: the node's speed is the model's,
not the host's.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sim.config import BackendConfig
from sim.faults import FaultState
from sim.gate import ConcurrencyGate
from sim.metrics import GaugeSnapshot, SimMetrics
from sim.model import (
    GPU_CLASSES,
    KvMemory,
    block_hashes,
    decode_step_ms,
    draw_long_tail,
    gpu_util_percent,
    output_length,
    prefill_ms,
    session_tokens,
    time_factor,
)
from sim.protocol import InferenceRequest

#: Shortest wall-clock time between two wake-ups of one request's decode loop, s.
TICK_S = 0.004

async def sleep_until(loop: asyncio.AbstractEventLoop, due: float) -> None:
    """Sleep until ``loop.time()`` reaches ``due`` (s); when it already has, only yield to the loop."""
    await asyncio.sleep(max(0.0, due - loop.time()))


#: Requests whose time on the node :attr:`SimNode.spans` keeps (the most recent ones).
SPANS_KEPT = 200_000

#: Words the simulated replies are made of (one token each).
_WORDS = ("Simulated", "reply", "from")


class OutOfMemory(Exception):
    """Admitting the request would exceed GPU memory (sizes in MiB)."""

    def __init__(self, requested_mib: float, free_mib: float, total_mib: float) -> None:
        self.requested_mib = requested_mib
        self.free_mib = free_mib
        self.total_mib = total_mib
        super().__init__(
            f"CUDA out of memory. Tried to allocate {requested_mib:.0f} MiB "
            f"(GPU 0; {total_mib:.0f} MiB total capacity; {free_mib:.0f} MiB free)"
        )


class NodeClosing(Exception):
    """The node is shutting down; the request was not served."""


@dataclass
class Job:
    """One request inside the node (mutable state of its run).

    ``tokens``: every prompt token the KV cache sees (session history first, if any); ``keys``:
    their full blocks' keys. ``output_tokens``: tokens it will generate. ``factor``: multiplier of
    all its times. Times in seconds (loop clock), memory in MiB / tokens.
    """

    req: InferenceRequest
    request_id: str
    tokens: tuple[int, ...]
    keys: list[int]
    output_tokens: int
    factor: float
    long_tail: bool
    session_hit: bool | None = None
    history_tokens: int = 0
    produced: int = 0
    cached_tokens: int = 0
    reserved_mib: float = 0.0
    held_keys: list[int] = field(default_factory=list)
    held_hits: int = 0
    computed: bool = False
    held_tokens: int = 0
    preempted: bool = False
    preemptions: int = 0
    arrived: float = 0.0
    queue_s: float = 0.0
    first_token_s: float | None = None
    prefill_s: float = 0.0
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


def gpu_uuid_for(hostname: str, served_by: str, seed: int | None) -> str:
    """Deterministic DCGM-style GPU UUID (``GPU-xxxxxxxx-...``) for one backend address."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"inferlb-sim://{hostname}/{served_by}/{seed}"))


class SimNode:
    """State and behaviour of one simulated backend. Use from a single event loop."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.gpu = GPU_CLASSES[cfg.gpu_class]
        self.memory = KvMemory(cfg.gpu_memory_total_mib, cfg.weights_mib, cfg.kv_mib_per_token, cfg.block_size)
        self.gate = ConcurrencyGate(cfg.max_concurrency)
        self.faults = FaultState(cfg.long_tail)
        self.rng = random.Random(cfg.seed)
        self.served_by = f"{cfg.host}:{cfg.port}"
        self.metrics = SimMetrics(
            model_name=cfg.model_name,
            gpu_model_name=self.gpu.dcgm_model_name,
            gpu_uuid=gpu_uuid_for(cfg.hostname, self.served_by, cfg.seed),
            hostname=cfg.hostname,
            legacy_kv_name=cfg.legacy_metrics,
        )
        self.counters = {
            "requests": 0,
            "success": 0,
            "oom": 0,
            "bad_requests": 0,
            "cancelled": 0,
            "session_hits": 0,
            "session_misses": 0,
            "long_tail": 0,
            "preemptions": 0,
            "prefix_queried_tokens": 0,
            "prefix_hit_tokens": 0,
        }
        self.hung = 0  # requests currently held by the hang fault
        self.spans: deque[tuple[float, float]] = deque(maxlen=SPANS_KEPT)
        """``(arrived, left)`` wall-clock times (s, ``time.time()``) of every request that held the node:
        from its arrival (a hang fault's wait included) to the release of its slot and memory, however
        it ended; a request refused at once (out of memory, shutting down) has none. Oldest first; the
        last :data:`SPANS_KEPT`."""
        self._seq = 0
        self._running: list[Job] = []  # jobs holding KV, oldest start first
        self._freed = asyncio.Event()

    def bind(self, served_by: str) -> None:
        """Record the address actually listened on (``HOST:PORT``), e.g. after binding port 0."""
        self.served_by = served_by
        self.metrics.set_gpu_uuid(gpu_uuid_for(self.cfg.hostname, served_by, self.cfg.seed))

    # --- the request's life ----------------------------------------------------------------------

    def new_job(self, req: InferenceRequest) -> Job:
        """Make the job of ``req``: its id, prompt tokens and block keys, output length, long-tail draw."""
        self._seq += 1
        self.counters["requests"] += 1
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        history: list[int] = []
        if req.session_key is not None and self.cfg.session_history_tokens:
            history = session_tokens(req.session_key, self.cfg.session_history_tokens)
        tokens = (*history, *req.tokens) if history else (req.tokens or (0,) * max(1, req.prompt_tokens))
        keys = block_hashes(tokens, self.cfg.block_size) if self.cfg.prefix_caching else []
        out = output_length(self.rng, req.max_tokens if req.max_tokens_given else None, self.cfg.default_max_tokens)
        long_tail = draw_long_tail(self.rng, self.faults.long_tail)
        if long_tail:
            self.counters["long_tail"] += 1
        return Job(req=req, request_id=f"{prefix}-{self.metrics.gpu_uuid[4:12]}-{self._seq}", tokens=tokens,
                   keys=keys, output_tokens=out, factor=1.0, long_tail=long_tail,
                   session_hit=None if not history else False, history_tokens=len(history))

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
            e2e_s=job.finished_s, memory_mib=job.reserved_mib, prompt_tokens=job.req.prompt_tokens,
            completion_tokens=job.output_tokens, cached_tokens=max(0, job.cached_tokens - job.history_tokens),
            finish_reason=job.finish_reason, session_hit=job.session_hit, long_tail=job.long_tail,
            preemptions=job.preemptions)

    # --- internals -------------------------------------------------------------------------------

    def _oom(self) -> None:
        self.counters["oom"] += 1
        self.metrics.observe_oom()

    def _wake(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    def _recompute_tokens(self, job: Job) -> int:
        """Tokens to prefill again after a preemption: the uncached prompt plus what was generated."""
        return len(job.tokens) - job.cached_tokens + job.produced

    async def _admit(self, job: Job, first_run: bool) -> None:
        """Give ``job`` its KV memory: the cached leading blocks are shared, the rest allocated
        (unused cached blocks evicted LRU first). ``oom_mode: error`` also reserves the whole
        output; ``preempt`` waits for memory while other requests run. Raises OutOfMemory."""
        mem = self.memory
        keys = job.keys
        hit = mem.cache.match(keys)
        # At least one prompt token is always computed (vLLM recomputes the last one).
        while hit and hit * self.cfg.block_size >= len(job.tokens):
            hit -= 1
        if first_run:
            job.cached_tokens = hit * self.cfg.block_size
            if job.session_hit is not None:
                job.session_hit = hit > 0
                self.counters["session_hits" if job.session_hit else "session_misses"] += 1
                self.metrics.observe_session(job.session_hit)
            queried = len(job.tokens)
            self.counters["prefix_queried_tokens"] += queried
            self.counters["prefix_hit_tokens"] += job.cached_tokens
            self.metrics.observe_prefix(queried, job.cached_tokens)
        if job.reserved_mib:  # an explicit size covers the request's whole KV: read the cache only
            self._running.append(job)
            return
        loose = len(job.tokens) - len(keys) * self.cfg.block_size + job.produced
        if self.cfg.oom_mode == "error":
            loose += job.output_tokens - job.produced
        new = len(keys) - hit
        mem.cache.acquire(keys[:hit])  # pin the hits before making room
        while True:
            need = mem.blocks_mib(new, loose)
            if mem.make_room(need):
                break
            if self.cfg.oom_mode == "error" or not self._running:
                mem.cache.release(keys[:hit])
                self._oom()
                raise OutOfMemory(need, mem.free_mib, mem.total_mib)
            await self._freed.wait()  # preempt mode: wait like vLLM's waiting queue
        mem.cache.acquire(keys[hit:])
        mem.held_tokens += loose
        job.computed = False
        job.held_hits = hit
        job.held_keys = list(keys)
        job.held_tokens = loose
        self._running.append(job)

    def _free(self, job: Job) -> None:
        """Give back ``job``'s blocks (they stay cached, unused) and loose tokens."""
        if job in self._running:
            self._running.remove(job)
        if job.held_keys:
            # Blocks whose prefill did not finish were never computed: they leave the cache.
            hits, new = job.held_keys[:job.held_hits], job.held_keys[job.held_hits:]
            self.memory.cache.release(hits)
            self.memory.cache.release(new, keep=job.computed)
            job.held_keys = []
        self.memory.held_tokens -= job.held_tokens
        job.held_tokens = 0
        self._wake()

    def _preempt(self, victim: Job) -> None:
        """vLLM's recompute preemption: the victim's KV goes back now; it runs again later."""
        self._free(victim)
        victim.preempted = True
        victim.preemptions += 1
        self.counters["preemptions"] += 1
        self.metrics.observe_preemption()

    async def _requeue(self, job: Job) -> None:
        """A preempted job gives up its slot and waits at the head of the queue for another."""
        job.preempted = False
        self.gate.release()
        await self.gate.acquire(front=True)

    async def _grow(self, job: Job, k: int) -> bool:
        """Room for ``k`` more generated tokens (preempt mode); preempts the newest running requests
        if needed. False when ``job`` itself was preempted. Raises OutOfMemory when ``job`` runs
        alone and still cannot grow."""
        mem = self.memory
        while not mem.make_room(k * mem.kv_mib_per_token):
            victim = self._running[-1] if self._running else job
            if victim is job and len(self._running) <= 1:
                self._oom()
                raise OutOfMemory(k * mem.kv_mib_per_token, mem.free_mib, mem.total_mib)
            self._preempt(victim)
            if victim is job:
                return False
        mem.held_tokens += k
        job.held_tokens += k
        return True

    async def generate(self, job: Job) -> AsyncIterator[int]:
        """Run ``job``; yields the number of new output tokens each time some come out (the first
        yield is the first token, at TTFT). Raises :class:`OutOfMemory` (before any token) when its
        memory cannot fit, :class:`NodeClosing` on shutdown. Memory and the running slot are
        released however it ends (also when the consumer stops early)."""
        arrived = time.time()
        self.hung += 1
        try:
            await self.faults.wait_while(lambda: self.faults.hang)
        finally:
            self.hung -= 1
        if self.faults.closing:
            raise NodeClosing("backend is shutting down")
        job.factor = time_factor(self.gpu, time_scale=self.cfg.time_scale, slow_factor=self.faults.slow_factor,
                                 long_tail=job.long_tail)
        if job.req.memory_mib is not None:
            if not self.memory.try_reserve(job.req.memory_mib):
                self._oom()
                raise OutOfMemory(job.req.memory_mib, self.memory.free_mib, self.memory.total_mib)
            job.reserved_mib = job.req.memory_mib
        loop = asyncio.get_running_loop()
        job.arrived = loop.time()
        first_run = True
        finished = False
        try:
            await self.gate.acquire()
            try:
                while not finished:
                    await self._admit(job, first_run)
                    if first_run:
                        job.queue_s = loop.time() - job.arrived
                        uncached = len(job.tokens) - job.cached_tokens
                    else:
                        uncached = self._recompute_tokens(job)
                    first_run = False
                    p = prefill_ms(uncached, job.factor) / 1000.0
                    due = loop.time() + p
                    if p > 0:
                        await sleep_until(loop, due)
                    if job.preempted:
                        await self._requeue(job)
                        continue
                    job.prefill_s += p
                    job.computed = True
                    if job.produced == 0:
                        job.produced = 1
                        job.first_token_s = loop.time() - job.arrived
                        yield 1
                    while job.produced < job.output_tokens:
                        step = decode_step_ms(self.gate.running, job.factor) / 1000.0
                        k = min(job.output_tokens - job.produced, max(1, math.ceil(TICK_S / step)) if step > 0
                                else job.output_tokens)
                        if self.cfg.oom_mode == "preempt" and not job.reserved_mib and not await self._grow(job, k):
                            break
                        due += k * step
                        await sleep_until(loop, due)
                        if job.preempted:
                            break
                        job.produced += k
                        self.metrics.observe_inter_token(step, k)
                        yield k
                    if job.preempted:
                        await self._requeue(job)
                        continue
                    finished = True
            finally:
                self._free(job)
                self.gate.release()
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["cancelled"] += 1
            raise
        finally:
            if job.reserved_mib:
                self.memory.release(job.reserved_mib)
                self._wake()
            self.spans.append((arrived, time.time()))
        job.finished_s = loop.time() - job.arrived
        self._finish(job)

    def _finish(self, job: Job) -> None:
        self.counters["success"] += 1
        ttft = job.first_token_s or 0.0
        tpot = (job.finished_s - ttft) / (job.output_tokens - 1) if job.output_tokens > 1 else None
        self.metrics.observe_finished(
            e2e_s=job.finished_s,
            ttft_s=ttft,
            queue_s=job.queue_s,
            prompt_tokens=job.req.prompt_tokens,
            generation_tokens=job.output_tokens,
            finished_reason=job.finish_reason,
            tpot_s=tpot,
            prefill_s=job.prefill_s,
        )

    # --- views -----------------------------------------------------------------------------------

    def gauges(self) -> GaugeSnapshot:
        """Current gauge values for the exposition."""
        return GaugeSnapshot(
            running=self.gate.running,
            waiting=self.gate.waiting,
            kv_usage=self.memory.kv_usage,
            gpu_util_percent=gpu_util_percent(self.gate.running, self.cfg.max_concurrency),
            fb_used_mib=self.memory.used_mib,
            fb_free_mib=self.memory.free_mib,
        )

    def spans_since(self, since: float) -> list[tuple[float, float]]:
        """The :attr:`spans` of the requests that left at or after ``since`` (wall s), oldest first."""
        return [s for s in self.spans if s[1] >= since]

    def state(self) -> dict[str, Any]:
        """JSON-able view of the node for ``GET /sim/state`` (memory in MiB, kv_usage 0-1)."""
        mem = self.memory
        return {
            "served_by": self.served_by,
            "version": self.cfg.version,
            "model_name": self.cfg.model_name,
            "gpu_class": self.gpu.key,
            "gpu_model_name": self.gpu.dcgm_model_name,
            "time_scale": self.cfg.time_scale,
            "max_concurrency": self.cfg.max_concurrency,
            "oom_mode": self.cfg.oom_mode,
            "running": self.gate.running,
            "waiting": self.gate.waiting,
            "hung": self.hung,
            "gpu_util_percent": gpu_util_percent(self.gate.running, self.cfg.max_concurrency),
            "memory": {
                "total_mib": mem.total_mib,
                "weights_mib": mem.weights_mib,
                "held_mib": mem.held_mib,
                "used_mib": mem.used_mib,
                "free_mib": mem.free_mib,
                "kv_usage": mem.kv_usage,
                "cached_free_mib": mem.cached_free_mib,
            },
            "prefix_cache": {
                "block_size": self.cfg.block_size,
                "blocks": len(mem.cache),
                "unused_blocks": mem.cache.free_blocks,
                "evicted_blocks": mem.evicted_blocks,
            },
            "faults": self.faults.as_dict(),
            "counters": dict(self.counters),
        }
