"""The ``job`` engine: the seed's per-request GPU server, as a pure state machine.

It models the servers of the seed article's traps (section 3.3, the max-concurrency story; the
image-generation, speech and classification services): a model served a request at a time by its
own wrapper, where every request holds its own GPU memory and each concurrent request slows the
others more than in proportion. Contract: :mod:`sim.engines.api`.

- **Slots:** at most ``max_concurrency`` requests run; the others wait first come, first served.
- **Memory:** GPU memory = weights + what the requests hold. A request that declares its size
  (``EngineRequest.memory_mib``: an 8 GB image job) reserves it when it arrives, queued or not,
  and is refused at once (:data:`~sim.engines.api.FAIL_OOM`, the server's "CUDA out of memory")
  when it does not fit. Any other request holds KV memory for its prompt and its whole output
  (``kv_mib_per_token`` each) from the moment it starts, and fails with the same error then if that
  does not fit. Memory is given back when the request ends. No prefix cache.
- **Time** (an A100-class GPU; other classes multiply every time by their
  ``job_latency_factor``, and so do the ``slow_factor`` fault, read when a request starts, and a
  request's ``slowdown``): the prompt is prefilled at :data:`PREFILL_MS_PER_TOKEN` per token (the
  first token comes out at its end), then every further token takes one decode step of
  :func:`decode_step_ms` (batch), the batch being the requests running at that moment. The step is
  set so that the seed's short request (:data:`REF_PROMPT_TOKENS` prompt tokens,
  :data:`REF_OUTPUT_TOKENS` output tokens) takes 50 ms alone, 95 ms with 2 running and 220 ms with 4
  (:data:`LATENCY_TABLE_MS`): each request added *lowers* the GPU's tokens per second, unlike a
  continuous-batching engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.engines.api import (
    FAIL_OOM,
    EngineEvent,
    EngineRequest,
    EngineStats,
    Failed,
    Finished,
    FirstToken,
    KvEvent,
    Tokens,
)
from sim.engines.hardware import GPU_CLASSES

#: The seed's figures for a short request of a 7B model on one A100: (requests running, end-to-end ms).
LATENCY_TABLE_MS: tuple[tuple[int, float], ...] = ((1, 50.0), (2, 95.0), (4, 220.0))

#: Prefill cost per prompt token on an A100, ms (10 000 tokens/s, the order of a 7B model).
PREFILL_MS_PER_TOKEN = 0.1

#: The reference short request whose end-to-end latency is :data:`LATENCY_TABLE_MS`.
REF_PROMPT_TOKENS = 16
REF_OUTPUT_TOKENS = 16

#: Memory of a 7B model's weights in fp16 (MiB), and KV memory per token of a 7B Llama-2-class
#: model in fp16: 2 (K, V) x 32 layers x 4096 x 2 bytes = 0.5 MiB.
DEFAULT_WEIGHTS_MIB = 14336.0
DEFAULT_KV_MIB_PER_TOKEN = 0.5
DEFAULT_MAX_CONCURRENCY = 8


def base_latency_ms(running: int) -> float:
    """A100 end-to-end latency (ms) of the reference short request with ``running`` requests
    running (itself included): piecewise-linear through :data:`LATENCY_TABLE_MS`, extrapolated
    beyond the last point with the last segment's slope (62.5 ms per request); < 1 counts as 1."""
    n = max(1, running)
    points = LATENCY_TABLE_MS
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (n - x1)


def prefill_ms(tokens: int) -> float:
    """A100 prefill time of ``tokens`` prompt tokens, ms."""
    return max(0, tokens) * PREFILL_MS_PER_TOKEN


def decode_step_ms(running: int) -> float:
    """A100 time of one decode step with ``running`` requests running, ms: chosen so that the
    reference request takes :func:`base_latency_ms`: ``prefill(REF_PROMPT) + (REF_OUTPUT - 1) x step``."""
    return (base_latency_ms(running) - prefill_ms(REF_PROMPT_TOKENS)) / (REF_OUTPUT_TOKENS - 1)


def request_latency_ms(prompt_tokens: int, output_tokens: int, running: int) -> float:
    """A100 end-to-end time of a request at a constant batch: prefill + (output - 1) steps, ms."""
    return prefill_ms(prompt_tokens) + max(0, output_tokens - 1) * decode_step_ms(running)


class _Job:
    __slots__ = ("req", "order", "memory", "reserved", "factor", "phase", "start_s", "prefill_end",
                 "progress", "reported", "report_s", "first_s")

    def __init__(self, req: EngineRequest, order: int) -> None:
        self.req = req
        self.order = order
        self.memory = 0.0      # MiB held (reservation or KV)
        self.reserved = False  # memory reserved at arrival (declared size)
        self.factor = 1.0
        self.phase = 0         # 0 queued, 1 prefill, 2 decode
        self.start_s = 0.0
        self.prefill_end = 0.0
        self.progress = 0.0    # decode steps done (float: steps of changing length)
        self.reported = 0
        self.report_s = 0.0
        self.first_s = 0.0


@dataclass(frozen=True)
class JobSpec:
    """The resolved settings of one ``job`` engine (see :class:`JobEngine`)."""

    gpu: str
    latency_factor: float
    max_concurrency: int
    gpu_memory_mib: float
    weights_mib: float
    kv_mib_per_token: float


class JobEngine:
    """A per-request GPU server (see the module docstring).

    Arguments: ``gpu`` (a key of :data:`sim.engines.hardware.GPU_CLASSES`: its memory and
    ``job_latency_factor``), ``max_concurrency`` (>= 1; None: 8), ``gpu_memory_mib`` (None: the class's),
    ``weights_mib``, ``kv_mib_per_token`` (MiB), ``stream`` (report each running request's new tokens
    at every :meth:`advance`). Raises ValueError on an unknown class or memory that cannot hold the
    weights.
    """

    kind = "job"

    def __init__(self, gpu: str = "a100", *, max_concurrency: int | None = None,
                 gpu_memory_mib: float | None = None, weights_mib: float = DEFAULT_WEIGHTS_MIB,
                 kv_mib_per_token: float = DEFAULT_KV_MIB_PER_TOKEN, stream: bool = False) -> None:
        if gpu not in GPU_CLASSES:
            raise ValueError(f"gpu must be one of {sorted(GPU_CLASSES)}, got {gpu!r}")
        if max_concurrency is None:
            max_concurrency = DEFAULT_MAX_CONCURRENCY
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        g = GPU_CLASSES[gpu]
        memory = float(gpu_memory_mib if gpu_memory_mib is not None else g.memory_mib)
        if weights_mib < 0 or memory <= weights_mib:
            raise ValueError(f"gpu_memory_mib ({memory:g}) must exceed the model weights ({weights_mib:g} MiB)")
        if kv_mib_per_token < 0:
            raise ValueError("kv_mib_per_token must be >= 0")
        self.spec = JobSpec(gpu, g.job_latency_factor, max_concurrency, memory, float(weights_mib),
                            float(kv_mib_per_token))
        self._stream = stream
        self._slow = 1.0
        self._now = float("-inf")
        self._t = 0.0                  # progress of decoding jobs is counted up to here
        self._queue: list[_Job] = []   # waiting for a slot, FIFO
        self._running: list[_Job] = []
        self._by_id: dict[str, _Job] = {}
        self._held = 0.0               # MiB held by requests
        self._events: list[tuple[float, int, int, EngineEvent]] = []
        self._orders = 0
        self._c = {"finished": 0, "failed": 0, "prompt_tokens": 0, "generation_tokens": 0}

    # --- the contract ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now_s: float) -> None:
        """Queue ``request`` at ``now_s``; a declared size is reserved now (or refused: OOM)."""
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self._run_until(now_s)
        self._orders += 1
        job = _Job(request, self._orders)
        if request.memory_mib is not None:
            if not self._fits(request.memory_mib):
                self._fail(job, now_s, request.memory_mib)
                return
            job.memory, job.reserved = request.memory_mib, True
            self._held += job.memory
        self._by_id[request.request_id] = job
        self._queue.append(job)
        self._start_queued(now_s)

    def next_event_s(self) -> float | None:
        """The next prefill end or finish (s), None when nothing runs."""
        best = None
        step = self._step_ms()
        for job in self._running:
            if job.phase == 1:
                t = job.prefill_end
            else:
                t = self._t + max(0.0, job.req.output_tokens - 1 - job.progress) * step * job.factor / 1000.0
            if best is None or t < best:
                best = t
        return best

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run everything due at or before ``until_s``; the events since the last call, in time order."""
        self._run_until(until_s)
        if self._stream:
            step = self._step_ms()
            for job in self._running:
                done = 1 + math.floor(job.progress + 1e-9) if job.phase == 2 else 0
                if done > job.reported:
                    t = self._t - (job.progress - (done - 1)) * step * job.factor / 1000.0
                    self._report(job, done, max(t, job.report_s))
        if not self._events:
            return []
        self._events.sort(key=lambda e: e[:3])
        out = [e[3] for e in self._events]
        self._events = []
        return out

    def cancel(self, request_id: str, now_s: float) -> None:
        """Drop ``request_id`` at ``now_s``; its slot and memory go back; no event follows."""
        self._run_until(now_s)
        job = self._by_id.pop(request_id, None)
        if job is None:
            return
        if job in self._queue:
            self._queue.remove(job)
        else:
            self._running.remove(job)
        self._held -= job.memory
        self._start_queued(now_s)

    def set_slow_factor(self, factor: float, now_s: float) -> None:
        """Requests that start after ``now_s`` take ``factor`` (> 0) times longer."""
        if not factor > 0:
            raise ValueError(f"slow factor must be > 0, got {factor}")
        self._run_until(now_s)
        self._slow = float(factor)

    def stats(self) -> EngineStats:
        """Gauges and counters now; ``kv_usage`` is memory held by requests / (total - weights)."""
        sp = self.spec
        used = sp.weights_mib + self._held
        c = self._c
        return EngineStats(
            running=len(self._running), waiting=len(self._queue),
            kv_usage=min(1.0, self._held / (sp.gpu_memory_mib - sp.weights_mib)), kv_blocks_total=0,
            kv_blocks_used=0, memory_total_mib=sp.gpu_memory_mib, memory_used_mib=used,
            memory_free_mib=sp.gpu_memory_mib - used, prefix_queries=0, prefix_hits=0, preemptions=0,
            finished=c["finished"], failed=c["failed"], prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"])

    def drain_kv_events(self) -> list[KvEvent]:
        """None: a job server has no prefix cache."""
        return []

    # --- internals ------------------------------------------------------------------------------

    def _fits(self, mib: float) -> bool:
        return self.spec.weights_mib + self._held + mib <= self.spec.gpu_memory_mib + 1e-9

    def _fail(self, job: _Job, t: float, mib: float) -> None:
        sp = self.spec
        free = sp.gpu_memory_mib - sp.weights_mib - self._held
        self._c["failed"] += 1
        self._emit(t, job, Failed(job.req.request_id, t, FAIL_OOM,
                                  f"CUDA out of memory. Tried to allocate {mib:.0f} MiB (GPU 0; "
                                  f"{sp.gpu_memory_mib:.0f} MiB total capacity; {free:.0f} MiB free)"))

    def _step_ms(self) -> float:
        return decode_step_ms(len(self._running)) * self.spec.latency_factor

    def _progress_to(self, t: float) -> None:
        """Count decoding jobs' steps from ``self._t`` to ``t`` at the current batch."""
        if t > self._t:
            step = self._step_ms()
            for job in self._running:
                if job.phase == 2:
                    job.progress += (t - self._t) * 1000.0 / (step * job.factor)
        self._t = max(self._t, t)

    def _run_until(self, until: float) -> None:
        if until < self._now:
            raise ValueError(f"time went backwards: {until} after {self._now}")
        self._now = until
        while (t := self.next_event_s()) is not None and t <= until:
            self._progress_to(t)
            for job in list(self._running):
                if job.phase == 1 and job.prefill_end <= t:
                    self._first_token(job, t)
            step = self._step_ms()
            for job in list(self._running):
                if job.phase == 2 and (job.req.output_tokens - 1 - job.progress) * step * job.factor <= 1e-6:
                    self._finish(job, t)
            self._start_queued(t)
        self._progress_to(until)

    def _start_queued(self, t: float) -> None:
        """Start queued jobs while slots are free (FIFO); one whose KV does not fit fails (OOM)."""
        while self._queue and len(self._running) < self.spec.max_concurrency:
            job = self._queue.pop(0)
            if not job.reserved:
                need = self.spec.kv_mib_per_token * (len(job.req.prompt) + job.req.output_tokens)
                if not self._fits(need):
                    del self._by_id[job.req.request_id]
                    self._fail(job, t, need)
                    continue
                job.memory = need
                self._held += need
            self._progress_to(t)
            job.factor = self._slow * job.req.slowdown
            job.phase = 1
            job.start_s = t
            job.prefill_end = t + prefill_ms(len(job.req.prompt)) * self.spec.latency_factor * job.factor / 1000.0
            self._running.append(job)

    def _first_token(self, job: _Job, t: float) -> None:
        job.phase = 2
        job.first_s = job.report_s = t
        job.reported = 1
        self._c["prompt_tokens"] += len(job.req.prompt)
        self._emit(t, job, FirstToken(job.req.request_id, t, 0))
        if job.req.output_tokens == 1:
            self._finish(job, t)

    def _finish(self, job: _Job, t: float) -> None:
        self._report(job, job.req.output_tokens, t)
        self._emit(t, job, Finished(job.req.request_id, t, len(job.req.prompt), 0, job.req.output_tokens, 0,
                                    job.start_s - job.req.arrival_s, job.first_s))
        self._running.remove(job)
        del self._by_id[job.req.request_id]
        self._held -= job.memory
        self._c["finished"] += 1
        self._c["generation_tokens"] += job.req.output_tokens

    def _report(self, job: _Job, done: int, t: float) -> None:
        n = done - job.reported
        if n > 0:
            self._emit(t, job, Tokens(job.req.request_id, t, n, (t - job.report_s) / n))
            job.reported = done
            job.report_s = t

    def _emit(self, t: float, job: _Job, event: EngineEvent) -> None:
        self._events.append((t, job.order, {FirstToken: 0, Tokens: 1}.get(type(event), 2), event))
