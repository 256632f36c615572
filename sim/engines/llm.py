"""The ``llm`` engine: continuous batching as vLLM V1 schedules it, on BLIS's fitted step times.

A pure state machine in the caller's time (contract: :mod:`sim.engines.api`). What it models:

- **Steps.** The engine runs one step (one forward pass over its batch) after another while it has
  work. A step takes ``beta0 + beta1 x (uncached prefill tokens in it) + beta2 x (decode tokens in
  it)`` µs (:mod:`sim.engines.hardware`: BLIS's fit per GPU class), times the ``slow_factor`` fault.
  A request's first token comes out at the end of the step that completes its prefill; each later
  step it takes part in gives it one more token.
- **Scheduling** (vLLM V1, ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``), at the
  start of each step, within a token budget of ``max_num_batched_tokens`` and at most
  ``max_num_seqs`` running requests: first the running requests in the order they were admitted
  (a decoding one takes 1 token, one still prefilling takes ``min(remaining, budget)``: chunked
  prefill), allocating their KV blocks; when a running request's blocks do not fit, the running
  request admitted last is **preempted** (``self.running.pop()`` under the default FCFS policy):
  its blocks go back, it returns to the head of the waiting queue and later recomputes its prompt
  and the tokens it had generated (their blocks are often still in the prefix cache). Then, only if
  nothing was preempted in this step, waiting requests first-come-first-served while budget, slots
  and KV blocks allow (the first that does not fit stops the queue). Requests that arrive during a
  step join at the next one.
- **KV cache** (:mod:`sim.engines.kv`): blocks of ``block_size`` tokens, as many as the GPU's
  memory holds beside the weights (:func:`sim.engines.hardware.kv_cache_blocks`); automatic prefix
  caching with LRU eviction; KV-cache events. A request never runs out of memory: it waits or is
  preempted. Prompts longer than the context (``max_model_len``: the model's, capped at what the KV
  cache holds, as an operator must cap it for vLLM to start) are refused at once
  (:data:`~sim.engines.api.FAIL_TOO_LONG`), as vLLM's server refuses them with HTTP 400.
- The long-tail fault (``EngineRequest.slowdown`` = p > 1): the request takes part in one step out
  of p (and counts 1/p decode token in each step's time).

Generated token ids are a fixed sequence (:func:`output_token_id`), the same for every request, so
two identical prompts produce identical KV blocks, as greedy decoding would.

**Speed.** The engine does no work per step per request. Between changes of the batch (an arrival,
a prefill chunk, a finish, a preemption) every step is the same pure-decode step, so a run of them
is one *segment*, committed at once: each decoding request's output count is a closed form of the
step counter, and the KV blocks its generated tokens fill are counted per step from a histogram of
the decoding requests by position in their block (a request needs a new block every
``block_size`` steps), taken from the pool in one go and held anonymously
(:meth:`sim.engines.kv.BlockPool.take_anonymous`). What costs is per request (its admission,
prompt blocks, prefill steps and finish) and per segment, not per step or per token.
``python -m bench.engine_speed`` (16 A100 engines, 13 requests/s each of 256-token prompts for 256
tokens, 68 running per engine on average, 10 virtual minutes, 124 796 requests): 10.3 s of CPU on
the shared 2-core machine at a load average of about 3 (2026-12-07).

Generated tokens' blocks enter the prefix cache when a preemption gives them back (so the
resumed request finds them), and when a request that carries its output ids
(:attr:`~sim.engines.api.EngineRequest.output_ids`: a replayed chat's real reply, which its client
resends in the next turn's history) finishes: vLLM keys every block once it is full of computed
tokens, generated ones included, and a finished request's blocks stay cached until evicted (vLLM
docs, design/prefix_caching), so a chat's next turn finds its history *and* the reply's blocks.
Otherwise a finished request's generated blocks are freed without a key: no later prompt can
contain the engine's fixed generated ids, so their keys could never be hit.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from sim.engines.api import (
    FAIL_TOO_LONG,
    EngineEvent,
    EngineRequest,
    EngineStats,
    Failed,
    Finished,
    FirstToken,
    KvEvent,
    Tokens,
)
from sim.engines.hardware import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MODEL,
    GPU_CLASSES,
    MODELS,
    GpuClass,
    ModelSpec,
    StepCoefficients,
    kv_cache_blocks,
    step_coefficients,
)
from sim.engines.kv import ROOT_HASH, BlockPool, chain_hashes
from sim.engines.outbox import Outbox
from sim.tokens import VOCAB_SIZE

#: vLLM's default KV block size, tokens (``--block-size``).
BLOCK_SIZE = 16

_WAITING, _PREFILL, _DECODE = 0, 1, 2


#: Generated token ids repeat with this period (a fixed sequence, see :func:`output_token_id`).
_OUT_PERIOD = 4096
_OUT_IDS = tuple((i * 7919 + 11) % VOCAB_SIZE for i in range(2 * _OUT_PERIOD))


def output_token_id(i: int) -> int:
    """Token id of a request's ``i``-th generated token (0-based): a fixed sequence, the same for
    every request."""
    return _OUT_IDS[i % _OUT_PERIOD]


@dataclass(frozen=True)
class LlmSpec:
    """The resolved settings of one ``llm`` engine (see :class:`LlmEngine`'s arguments)."""

    gpu: GpuClass
    model: ModelSpec
    coefficients: StepCoefficients
    gpu_memory_mib: float
    gpu_memory_utilization: float
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_caching: bool


class _Seq:
    """One request inside the engine (mutable).

    A decoding request's outputs at step G are ``base + (G - g0) // pace``; it holds
    ``ceil((n_prompt + outputs - 1) / block_size)`` blocks: ``blocks`` by name (its prompt's and
    prefill's), the rest anonymously.
    """

    __slots__ = ("req", "order", "n_prompt", "target", "pace", "keys", "blocks", "n_keyed", "phase",
                 "computed", "base", "g0", "run_seq", "cached_tokens", "preemptions", "scheduled_s",
                 "first_token_s", "reported", "report_s", "ver", "alive", "hit_memo")

    def __init__(self, req: EngineRequest, order: int, pace: int) -> None:
        self.req = req
        self.order = order
        self.n_prompt = len(req.prompt)
        self.target = req.output_tokens
        self.pace = pace
        self.keys: list[int] = []      # chained keys of the full blocks known so far
        self.blocks: list[int] = []    # KV blocks held by name, in token order
        self.n_keyed = 0               # leading blocks already keyed (in the prefix cache)
        self.phase = _WAITING
        self.computed = 0              # tokens whose KV is computed (prefill phase)
        self.base = 0                  # outputs at step g0
        self.g0 = 0
        self.run_seq = -1              # position in the running list (admission order)
        self.cached_tokens = -1        # prompt tokens found cached at the first scheduling
        self.preemptions = 0
        self.scheduled_s = -1.0
        self.first_token_s = -1.0
        self.reported = 0              # outputs reported in events
        self.report_s = 0.0            # time of the last reported token
        self.ver = 0                   # bumped whenever entries scheduled for it go stale
        self.alive = True
        self.hit_memo: tuple[int, int, list[int], int] | None = None  # (pool version, max hit, hits, free)

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Ids of the sequence's tokens ``start``..``end - 1`` (prompt, then generated)."""
        n = self.n_prompt
        if end <= n:
            return self.req.prompt[start:end]
        head = self.req.prompt[start:n] if start < n else ()
        first = max(start, n) - n
        if self.req.output_ids is not None:
            return head + self.req.output_ids[first:end - n]
        if end - n - first <= _OUT_PERIOD:
            o = first % _OUT_PERIOD
            return head + _OUT_IDS[o:o + end - n - first]
        return head + tuple(output_token_id(i) for i in range(first, end - n))


@dataclass
class _Step:
    """A planned single step (it has prefill work, or needed the exact path). Its prefill blocks and
    admissions are applied when planned, its decode blocks and outputs when it ends.
    ``decode_blocks``: blocks its decoders take at the end (exact path: per decoder; None: from
    the histogram)."""

    t0: float
    d: float
    prefilled: list[_Seq]
    decode_blocks: list[tuple[_Seq, int, int]] | None = None


@dataclass
class _Segment:
    """``k`` identical pure-decode steps of ``d`` s from ``t0``, the first being step ``g_start``;
    ``done`` of them committed."""

    t0: float
    d: float
    k: int
    g_start: int
    done: int = 0


class LlmEngine:
    """A continuous-batching LLM engine on one GPU (see the module docstring).

    Arguments: ``gpu`` (a key of :data:`sim.engines.hardware.GPU_CLASSES`), ``model`` (of
    :data:`~sim.engines.hardware.MODELS`); ``max_num_seqs`` / ``max_num_batched_tokens`` (None:
    vLLM's defaults for the GPU); ``gpu_memory_utilization`` (0-1, vLLM's 0.9);
    ``gpu_memory_mib`` (None: the class's); ``max_model_len`` (None: the model's, capped at the KV
    cache's tokens); ``prefix_caching``; ``kv_events`` (record KV-cache events for
    :meth:`drain_kv_events`); ``stream`` (report each running request's new tokens at every
    :meth:`advance`; else once, before its ``Finished``); ``block_size`` (tokens);
    ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``: ``auto``, the model's, or ``fp8``, half the bytes).
    Raises ValueError on a setting vLLM would refuse (unknown GPU, model or KV-cache dtype, no room
    for the KV cache, ``max_num_batched_tokens < max_num_seqs``).
    """

    kind = "llm"

    def __init__(self, gpu: str = "a100", model: str = DEFAULT_MODEL, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                 gpu_memory_mib: float | None = None, max_model_len: int | None = None,
                 prefix_caching: bool = True, kv_events: bool = False, stream: bool = False,
                 block_size: int = BLOCK_SIZE, kv_cache_dtype: str = "auto") -> None:
        if gpu not in GPU_CLASSES:
            raise ValueError(f"gpu must be one of {sorted(GPU_CLASSES)}, got {gpu!r}")
        if model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be 1-1024 tokens, got {block_size}")
        g, m = GPU_CLASSES[gpu], MODELS[model]
        memory = float(gpu_memory_mib if gpu_memory_mib is not None else g.memory_mib)
        blocks = kv_cache_blocks(m, memory, block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                                 kv_cache_dtype=kv_cache_dtype)
        seqs = max_num_seqs if max_num_seqs is not None else g.max_num_seqs
        batched = max_num_batched_tokens if max_num_batched_tokens is not None else g.max_num_batched_tokens
        if seqs < 1 or batched < seqs:
            raise ValueError(f"need 1 <= max_num_seqs <= max_num_batched_tokens, got {seqs} and {batched} "
                             "(vLLM refuses max_num_batched_tokens < max_num_seqs)")
        limit = min(m.max_model_len, blocks * block_size)
        if max_model_len is not None:
            if not 1 <= max_model_len <= limit:
                raise ValueError(f"max_model_len must be 1-{limit} (the model's context and the KV cache), "
                                 f"got {max_model_len}")
            limit = max_model_len
        self.spec = LlmSpec(g, m, step_coefficients(m, g), memory, gpu_memory_utilization, block_size, blocks,
                            seqs, batched, limit, prefix_caching)
        self._bs = block_size
        self._coef = self.spec.coefficients
        self._pool = BlockPool(blocks, block_size, caching=prefix_caching, record_events=kv_events)
        self._kv_events = kv_events and prefix_caching
        self._stream = stream
        self._slow = 1.0
        self._now = float("-inf")  # the latest time the caller gave
        self._t = 0.0              # end of the last committed step (a scheduling point when no plan)
        self._g = 0                # steps committed
        self._plan: _Step | _Segment | None = None
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=64)  # (first step, t0, d) per plan
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}     # run_seq -> seq: vLLM's running list, in order
        self._prefilling: dict[int, _Seq] = {}  # running requests still prefilling, in order
        self._paced: dict[int, _Seq] = {}       # decoding requests with pace > 1
        self._n1 = 0                            # decoding requests with pace 1 ...
        self._hist = [0] * block_size           # ... by (n_prompt + base - g0) % block_size
        self._alloc_at: dict[int, list[tuple[_Seq, int]]] = {}  # step -> paced decoders needing a block
        self._fin: list[tuple[int, int, int, _Seq]] = []       # (step, order, ver, seq): decoders' last steps
        self._by_id: dict[str, _Seq] = {}
        self._outbox = Outbox()
        self._orders = 0
        self._run_seqs = 0
        self._c = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0, "finished": 0, "failed": 0,
                   "prompt_tokens": 0, "generation_tokens": 0}

    # --- the contract ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now_s: float) -> None:
        """Queue ``request`` at ``now_s`` (see :mod:`sim.engines.api`)."""
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self._run_until(now_s)
        self._orders += 1
        s = _Seq(request, self._orders, max(1, round(request.slowdown)))
        asked = s.n_prompt + s.target
        if asked > self.spec.max_model_len:
            self._c["failed"] += 1
            self._emit(now_s, s, Failed(
                request.request_id, now_s, FAIL_TOO_LONG,
                f"This model's maximum context length is {self.spec.max_model_len} tokens. However, you "
                f"requested {asked} tokens ({s.n_prompt} in the messages, {s.target} in the completion). "
                "Please reduce the length of the messages or completion."))
            return
        if self.spec.prefix_caching:
            if request.block_keys is None:
                s.keys = self._chain(s, 0, s.n_prompt // self._bs)
            elif len(request.block_keys) == s.n_prompt // self._bs:
                s.keys = list(request.block_keys)
            else:
                raise ValueError(f"request {request.request_id!r}: {len(request.block_keys)} block keys for "
                                 f"{s.n_prompt // self._bs} full blocks of {self._bs} tokens")
        self._by_id[request.request_id] = s
        if not self._running and not self._waiting and self._plan is None:
            self._t = max(self._t, now_s)  # an idle engine starts a step at once
        self._waiting.append(s)
        self._interrupt(now_s)

    def next_event_s(self) -> float | None:
        """When the engine next decides or emits something by itself (s), None when idle."""
        if self._plan is None:
            self._plan = self._schedule()
            if self._plan is None:
                return None
        p = self._plan
        return p.t0 + p.d if isinstance(p, _Step) else p.t0 + p.k * p.d

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run everything due at or before ``until_s``; the events since the last call, in time order."""
        self._run_until(until_s)
        if self._stream:
            self._report_running()
        return self._outbox.drain()

    def cancel(self, request_id: str, now_s: float) -> None:
        """Drop ``request_id`` at ``now_s``: its blocks go back (they stay cached); no event follows."""
        self._run_until(now_s)
        s = self._by_id.pop(request_id, None)
        if s is None:
            return
        if s.phase == _WAITING:
            self._waiting.remove(s)
        else:
            self._materialize_one(s)
            self._drop_running(s)
        s.alive = False
        s.ver += 1
        self._interrupt(now_s)

    def set_slow_factor(self, factor: float, now_s: float) -> None:
        """Steps that start after ``now_s`` take ``factor`` (> 0) times their time."""
        if not factor > 0:
            raise ValueError(f"slow factor must be > 0, got {factor}")
        self._run_until(now_s)
        self._slow = float(factor)
        self._interrupt(now_s)

    def stats(self) -> EngineStats:
        """Gauges and counters now (see :class:`~sim.engines.api.EngineStats`)."""
        total = self.spec.gpu_memory_mib
        used = total * self.spec.gpu_memory_utilization
        c = self._c
        return EngineStats(
            running=len(self._running), waiting=len(self._waiting), kv_usage=self._pool.usage,
            kv_blocks_total=self._pool.num_blocks, kv_blocks_used=self._pool.num_used,
            memory_total_mib=total, memory_used_mib=used, memory_free_mib=total - used,
            prefix_queries=c["prefix_queries"], prefix_hits=c["prefix_hits"], preemptions=c["preemptions"],
            finished=c["finished"], failed=c["failed"], prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"])

    def drain_kv_events(self) -> list[KvEvent]:
        """KV-cache events since the last drain (none unless built with ``kv_events``)."""
        return self._pool.drain_events()

    def reset_prefix_cache(self, now_s: float) -> bool:
        """Drop every cached block (vLLM's ``/reset_prefix_cache``); refused (False) while requests
        hold blocks."""
        self._run_until(now_s)
        return self._pool.reset(now_s)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache (in use or not)."""
        return self._pool.num_cached

    @property
    def evicted_blocks(self) -> int:
        """Cached blocks evicted so far."""
        return self._pool.evicted

    def step_end_s(self, now_s: float) -> float:
        """When the step in flight at ``now_s`` ends: the earliest a request that arrives then can be
        scheduled (``now_s`` when the engine is idle). A read: nothing changes."""
        p = self._plan
        if p is None:
            return max(now_s, self._t)
        if isinstance(p, _Step):
            return max(now_s, p.t0 + p.d)
        if now_s <= p.t0:
            return p.t0
        return min(p.t0 + math.ceil((now_s - p.t0) / p.d) * p.d, p.t0 + p.k * p.d) if p.d > 0 else now_s

    @property
    def running(self) -> int:
        """Requests in the running batch (:meth:`stats`' ``running``, read alone). A read: nothing changes."""
        return len(self._running)

    @property
    def free_blocks(self) -> int:
        """KV blocks no request uses (:meth:`stats`' ``kv_blocks_total - kv_blocks_used``, read alone)."""
        return self._pool.num_free

    @property
    def idle_cached_blocks(self) -> int:
        """Cached blocks no request is using: free, but a request that takes one evicts what it holds."""
        return self._pool.num_idle_cached

    def prefilled_tokens(self) -> int:
        """Prompt tokens already prefilled, beyond the prefix they found cached, of the requests still
        prefilling (their first token not out yet). A read: nothing changes."""
        return sum(s.computed - max(0, s.cached_tokens) for s in self._prefilling.values())

    def prefix_users(self, keys: Sequence[int]) -> list[int]:
        """For each leading block of ``keys`` (:func:`sim.engines.kv.chain_hashes` at this engine's
        block size) that its prefix cache holds now, how many requests use it (0: cached, idle, the
        next to be evicted when it reaches the head of the free queue). A read: nothing changes."""
        return self._pool.users(self._pool.hits(keys, len(keys)))

    # --- time -----------------------------------------------------------------------------------

    def _run_until(self, until: float) -> None:
        if until < self._now:
            raise ValueError(f"time went backwards: {until} after {self._now}")
        self._now = until
        while True:
            if self._plan is None:
                if self._t >= until:
                    break
                self._plan = self._schedule()
                if self._plan is None:
                    break
            p = self._plan
            if isinstance(p, _Step):
                if p.t0 + p.d > until:
                    break
                self._commit_step(p)
                continue
            n = min(_steps_by(p.t0, p.d, until), p.k) - p.done
            if n > 0:
                self._commit_decode(p, n)
            if p.done < p.k:
                break
            self._end_segment(p)

    def _interrupt(self, now: float) -> None:
        """The batch changes at ``now`` (an arrival, a cancel, a slower GPU): a pure-decode segment
        stops after the step in flight (a plan not started yet is dropped)."""
        p = self._plan
        if isinstance(p, _Segment):
            p.k = p.done + (1 if p.t0 + p.done * p.d < now else 0)
            if p.done == p.k:
                self._end_segment(p)

    def _step_end(self, g: int) -> float:
        """End time of step ``g`` (recent steps only; older ones: the oldest known)."""
        for g_start, t0, d in reversed(self._recent):
            if g >= g_start:
                return t0 + (g - g_start + 1) * d
        return self._recent[0][1] if self._recent else self._t

    # --- planning -------------------------------------------------------------------------------

    def _schedule(self) -> _Step | _Segment | None:
        """The plan from the scheduling point ``self._t`` (None: nothing to do)."""
        if not self._running and not self._waiting:
            return None
        if self._prefilling or self._head_admissible():
            return self._plan_step()
        return self._plan_segment()

    def _new_blocks(self, g: int) -> int:
        """Blocks the decoding requests take at step ``g`` (one each whose next token starts a block)."""
        n = self._hist[(2 - g) % self._bs]
        entries = self._alloc_at.get(g)
        if entries:
            n += sum(1 for s, v in entries if s.ver == v)
        return n

    def _decoders_due(self, g: int) -> int:
        """Decoding requests that take part in step ``g``."""
        return self._n1 + sum(1 for s in self._paced.values() if (g - s.g0) % s.pace == 0)

    def _decode_weight(self) -> float:
        """Decode tokens per step in the step time (a paced request counts 1 / pace)."""
        return self._n1 + sum(1.0 / s.pace for s in self._paced.values())

    def _head_admissible(self) -> bool:
        """Would the next step admit the head of the waiting queue?"""
        if not self._waiting or len(self._running) >= self.spec.max_num_seqs:
            return False
        g1 = self._g + 1
        budget = self.spec.max_num_batched_tokens - self._decoders_due(g1)
        if budget <= 0:
            return False
        _, _, need = self._admission(self._waiting[0], budget)
        return need <= self._pool.num_free - self._new_blocks(g1)

    def _admission(self, s: _Seq, budget: int) -> tuple[list[int], int, int]:
        """``(cache hits, tokens to schedule now, blocks that takes from the free queue)`` for
        waiting ``s`` with ``budget`` tokens left."""
        n_tok = s.n_prompt + s.base
        hits: list[int] = []
        free = 0
        if self.spec.prefix_caching:
            max_hit = (n_tok - 1) // self._bs  # the last token is always computed (its logits)
            pool = self._pool
            memo = s.hit_memo
            if memo is not None and memo[0] == pool.version and memo[1] == max_hit:
                hits, free = memo[2], memo[3]  # asked again with the cache unchanged (the head of the queue)
            else:
                if len(s.keys) < max_hit:
                    s.keys += self._chain(s, len(s.keys), max_hit)
                hits = pool.hits(s.keys, max_hit)
                free = pool.count_free(hits)
                s.hit_memo = (pool.version, max_hit, hits, free)
        computed = len(hits) * self._bs
        chunk = min(n_tok - computed, budget)
        new = -(-(computed + chunk) // self._bs) - len(hits)
        return hits, chunk, new + free

    def _plan_step(self) -> _Step:
        """One step with prefill work: decoders, running prefills (chunked), then admissions."""
        g1 = self._g + 1
        budget = self.spec.max_num_batched_tokens - self._decoders_due(g1)
        free = self._pool.num_free - self._new_blocks(g1)
        if free < 0:
            return self._plan_exact()
        pre = list(self._prefilling.values())
        if pre and sum(s.n_prompt + s.base - s.computed for s in pre) > budget:
            first = pre[0].run_seq
            for rs in reversed(self._running):
                if rs <= first:
                    break
                if rs not in self._prefilling:  # a decoder behind a prefill: the budget may starve it
                    return self._plan_exact()
        chunks: list[tuple[_Seq, int]] = []
        for s in pre:
            if budget == 0:
                break
            c = min(s.n_prompt + s.base - s.computed, budget)
            nb = -(-(s.computed + c) // self._bs) - len(s.blocks)
            if nb > free:
                return self._plan_exact()
            free -= nb
            budget -= c
            chunks.append((s, c))
        t = self._t
        prefill = 0
        done: list[_Seq] = []
        for s, c in chunks:
            self._grow(s, s.computed + c, t)
            s.computed += c
            prefill += c
            if s.computed == s.n_prompt + s.base:
                done.append(s)
        prefill += self._admit_waiting(budget, free, t, done)
        return self._step(t, prefill, self._decode_weight(), done)

    def _plan_exact(self) -> _Step:
        """One step scheduled request by request, as vLLM's loop does: needed when a running
        request's blocks do not fit (preemption) or a prefill may starve decoders of budget."""
        g1 = self._g + 1
        t = self._t
        self._materialize()
        order = list(self._running.values())
        budget = self.spec.max_num_batched_tokens
        free = self._pool.num_free
        preempted = False
        prefill = 0
        decode_blocks: list[tuple[_Seq, int, int]] = []
        done: list[_Seq] = []
        i = 0
        while i < len(order) and budget > 0:
            s = order[i]
            if s.phase == _DECODE:
                if (g1 - s.g0) % s.pace:
                    i += 1
                    continue
                n = 1
                nb = -(-(s.n_prompt + s.base) // self._bs) - -(-(s.n_prompt + s.base - 1) // self._bs)
            else:
                n = min(s.n_prompt + s.base - s.computed, budget)
                nb = -(-(s.computed + n) // self._bs) - len(s.blocks)
            while nb > free:
                victim = order.pop()
                before = self._pool.num_free
                self._preempt(victim)
                free += self._pool.num_free - before  # blocks it shared with others stay in use
                preempted = True
                if victim is s:
                    break
            if s.phase == _WAITING:  # it preempted itself: nothing more is scheduled
                break
            free -= nb
            if s.phase == _DECODE:
                decode_blocks.append((s, s.ver, nb))
            else:
                self._grow(s, s.computed + n, t)
                s.computed += n
                prefill += n
                if s.computed == s.n_prompt + s.base:
                    done.append(s)
            budget -= n
            i += 1
        for s in order[i:]:  # due but not scheduled this step: they do not advance
            if s.phase == _DECODE and (g1 - s.g0) % s.pace == 0:
                s.g0 += 1
        self._hist = [0] * self._bs
        for s in self._running.values():
            if s.phase == _DECODE:
                self._remove_decoder(s, histogram=False)
                self._add_decoder(s)
        if not preempted:
            prefill += self._admit_waiting(budget, free, t, done)
        step = self._step(t, prefill, len(decode_blocks), done)
        step.decode_blocks = decode_blocks
        if not prefill and not decode_blocks:
            step.d = 0.0  # everything was preempted: schedule again at once
        return step

    def _plan_segment(self) -> _Segment | _Step:
        """Pure-decode steps up to the next finish, as many as the free blocks allow."""
        fin = self._fin
        while fin and fin[0][3].ver != fin[0][2]:
            heapq.heappop(fin)
        g = self._g
        k = fin[0][0] - g
        free = self._pool.num_free
        if (self._n1 + len(self._paced)) * (k // self._bs + 1) > free:  # the blocks may run out: count
            used = 0
            for i in range(1, k + 1):
                used += self._new_blocks(g + i)
                if used > free:
                    k = i - 1
                    break
            if k == 0:
                return self._plan_exact()
        seg = _Segment(self._t, self._coef.step_s(0, self._decode_weight()) * self._slow, k, g + 1)
        self._recent.append((seg.g_start, seg.t0, seg.d))
        return seg

    def _step(self, t: float, prefill: float, decode: float, done: list[_Seq]) -> _Step:
        step = _Step(t, self._coef.step_s(prefill, decode) * self._slow, done)
        self._recent.append((self._g + 1, t, step.d))
        return step

    def _admit_waiting(self, budget: int, free: int, t: float, done: list[_Seq]) -> int:
        """Admit waiting requests FCFS while budget, slots and ``free`` blocks (what the running
        requests leave) allow; their prefill tokens."""
        prefill = 0
        reserved = self._pool.num_free - free  # blocks the decoders take at the end of the step
        while self._waiting and budget > 0 and len(self._running) < self.spec.max_num_seqs:
            s = self._waiting[0]
            hits, chunk, need = self._admission(s, budget)
            if need > self._pool.num_free - reserved:
                break
            self._waiting.popleft()
            if s.cached_tokens < 0:
                s.cached_tokens = len(hits) * self._bs
                s.scheduled_s = t
                self._c["prefix_queries"] += s.n_prompt
                self._c["prefix_hits"] += s.cached_tokens
            self._pool.touch(hits)
            s.blocks = list(hits)
            s.n_keyed = len(hits)
            s.computed = len(hits) * self._bs
            self._grow(s, s.computed + chunk, t)
            s.computed += chunk
            prefill += chunk
            budget -= chunk
            self._run_seqs += 1
            s.run_seq = self._run_seqs
            s.phase = _PREFILL
            self._running[s.run_seq] = s
            self._prefilling[s.run_seq] = s
            if s.computed == s.n_prompt + s.base:
                done.append(s)
        return prefill

    # --- blocks ---------------------------------------------------------------------------------

    def _chain(self, s: _Seq, start: int, end: int) -> list[int]:
        """Keys of ``s``'s full blocks ``start``..``end - 1`` (``s.keys`` holds those before)."""
        bs = self._bs
        return chain_hashes(s.tokens(start * bs, end * bs), bs, parent=s.keys[start - 1] if start else ROOT_HASH)

    def _grow(self, s: _Seq, known: int, t: float) -> None:
        """Give ``s`` blocks by name until they hold ``known`` tokens; key those full of known tokens."""
        need = -(-known // self._bs) - len(s.blocks)
        if need > 0:
            s.blocks += self._pool.take(need, t)
        self._key_full(s, known, t)

    def _key_full(self, s: _Seq, known: int, t: float) -> None:
        """Store ``s``'s named blocks that are full of its first ``known`` tokens in the prefix cache."""
        if not self.spec.prefix_caching:
            return
        full = min(known // self._bs, len(s.blocks))
        k0 = s.n_keyed
        if full <= k0:
            return
        if len(s.keys) < full:
            s.keys += self._chain(s, len(s.keys), full)
        bs = self._bs
        tokens = s.tokens(k0 * bs, full * bs) if self._kv_events else ()
        self._pool.store(s.blocks[k0:full], s.keys[k0:full], tokens, s.keys[k0 - 1] if k0 else None, t)
        s.n_keyed = full

    def _held(self, s: _Seq) -> int:
        """Blocks ``s`` holds (named and anonymous)."""
        if s.phase == _DECODE:
            return -(-(s.n_prompt + s.base + (self._g - s.g0) // s.pace - 1) // self._bs)
        return len(s.blocks)

    # --- decoders -------------------------------------------------------------------------------

    def _add_decoder(self, s: _Seq) -> None:
        """Count decoding ``s`` in the step time and block schedule; register its last step."""
        s.phase = _DECODE
        fin = s.g0 + (s.target - s.base) * s.pace
        heapq.heappush(self._fin, (fin, s.order, s.ver, s))
        if s.pace == 1:
            self._n1 += 1
            self._hist[(s.n_prompt + s.base - s.g0) % self._bs] += 1
            return
        self._paced[s.run_seq] = s
        held = -(-(s.n_prompt + s.base - 1) // self._bs)
        nxt = s.g0 + (self._bs * held - s.n_prompt - s.base + 2) * s.pace
        if nxt <= fin:
            self._alloc_at.setdefault(nxt, []).append((s, s.ver))

    def _remove_decoder(self, s: _Seq, *, histogram: bool = True) -> None:
        if s.pace == 1:
            self._n1 -= 1
            if histogram:
                self._hist[(s.n_prompt + s.base - s.g0) % self._bs] -= 1
        else:
            del self._paced[s.run_seq]

    def _take_decode_blocks(self, g: int, t: float) -> int:
        """Paced decoders' blocks of step ``g`` (scheduling their next); how many."""
        entries = self._alloc_at.pop(g, None)
        if not entries:
            return 0
        n = 0
        period = self._bs
        for s, v in entries:
            if s.ver == v:
                n += 1
                nxt = g + period * s.pace
                if nxt <= s.g0 + (s.target - s.base) * s.pace:
                    self._alloc_at.setdefault(nxt, []).append((s, v))
        return n

    def _outputs(self, s: _Seq) -> int:
        """Output tokens ``s`` has now."""
        if s.phase == _DECODE:
            return s.base + (self._g - s.g0) // s.pace
        return s.base

    def _materialize_one(self, s: _Seq) -> None:
        """Fold a decoder's closed form into ``base`` / ``g0`` at the current step (same histogram slot)."""
        if s.phase != _DECODE:
            return
        elapsed = self._g - s.g0
        s.base += elapsed // s.pace
        s.g0 = self._g - elapsed % s.pace
        s.ver += 1

    def _materialize(self) -> None:
        """Fold every decoder's closed form; their scheduled entries are dropped (rebuilt after)."""
        for s in self._running.values():
            self._materialize_one(s)
        self._fin.clear()
        self._alloc_at.clear()

    # --- state changes --------------------------------------------------------------------------

    def _drop_running(self, s: _Seq, *, key: bool = True) -> None:
        """Take ``s`` out of the running list. Its blocks go back: named ones full of computed tokens
        stay cached, anonymous ones too when ``key`` (a preemption), else they go back unkeyed."""
        computed = s.computed
        if s.phase == _DECODE:
            computed = s.n_prompt + self._outputs(s) - 1
            anonymous = self._held(s) - len(s.blocks)
            if key:
                s.blocks += self._pool.adopt(anonymous)
            else:
                self._pool.release_anonymous(anonymous)
            self._remove_decoder(s)
        elif s.phase == _PREFILL:
            del self._prefilling[s.run_seq]
        self._key_full(s, computed, self._t)
        self._pool.release(s.blocks)
        s.blocks = []
        s.n_keyed = 0
        del self._running[s.run_seq]

    def _preempt(self, s: _Seq) -> None:
        """vLLM's recompute preemption: ``s`` gives its blocks back and waits at the queue's head."""
        self._drop_running(s)
        s.phase = _WAITING
        s.computed = 0
        s.preemptions += 1
        s.ver += 1
        self._c["preemptions"] += 1
        self._waiting.appendleft(s)

    def _commit_step(self, p: _Step) -> None:
        self._g += 1
        g = self._g
        self._t = t = p.t0 + p.d
        self._plan = None
        if p.decode_blocks is None:
            n = self._hist[(2 - g) % self._bs] + self._take_decode_blocks(g, t)
        else:
            n = sum(nb for s, v, nb in p.decode_blocks if s.ver == v)
            self._take_decode_blocks(g, t)
        self._pool.take_anonymous(n, t)
        for s in p.prefilled:
            if not s.alive or s.phase != _PREFILL:
                continue
            del self._prefilling[s.run_seq]
            s.base += 1
            if s.base == 1:
                s.first_token_s = s.report_s = t
                s.reported = 1
                self._c["prompt_tokens"] += s.n_prompt
                self._emit(t, s, FirstToken(s.req.request_id, t, s.cached_tokens))
            s.g0 = g
            self._add_decoder(s)
        self._pop_finished()

    def _commit_decode(self, p: _Segment, n: int) -> None:
        g = self._g
        hist, bs = self._hist, self._bs
        if n >= bs:
            blocks = (n // bs) * self._n1
            rest = n % bs
        else:
            blocks, rest = 0, n
        for step in range(g + n - rest + 1, g + n + 1):
            blocks += hist[(2 - step) % bs]
        if self._alloc_at:
            t_end = p.t0 + (g + n - p.g_start + 1) * p.d
            for step in range(g + 1, g + n + 1):
                blocks += self._take_decode_blocks(step, t_end)
        self._pool.take_anonymous(blocks, p.t0 + (g + n - p.g_start + 1) * p.d)
        self._g = g + n
        p.done += n

    def _end_segment(self, p: _Segment) -> None:
        self._t = p.t0 + p.done * p.d
        self._plan = None
        self._pop_finished()

    def _pop_finished(self) -> None:
        fin = self._fin
        while fin and fin[0][0] <= self._g:
            _, _, ver, s = heapq.heappop(fin)
            if s.ver == ver:
                self._finish(s, self._t)

    def _finish(self, s: _Seq, t: float) -> None:
        left = s.target - s.reported
        if left > 0:
            self._emit(t, s, Tokens(s.req.request_id, t, left, (t - s.report_s) / left))
        self._emit(t, s, Finished(s.req.request_id, t, s.n_prompt, max(0, s.cached_tokens), s.target,
                                  s.preemptions, s.scheduled_s - s.req.arrival_s, s.first_token_s))
        self._drop_running(s, key=s.req.output_ids is not None)
        del self._by_id[s.req.request_id]
        s.alive = False
        s.ver += 1
        self._c["finished"] += 1
        self._c["generation_tokens"] += s.target

    def _report_running(self) -> None:
        """Streaming: each decoding request's tokens since its last report."""
        for s in self._running.values():
            if s.phase != _DECODE:
                continue
            steps = (self._g - s.g0) // s.pace
            out = s.base + steps
            if out > s.reported:
                t = self._step_end(s.g0 + steps * s.pace)
                n = out - s.reported
                self._emit(t, s, Tokens(s.req.request_id, t, n, (t - s.report_s) / n))
                s.reported = out
                s.report_s = t

    def _emit(self, t: float, s: _Seq, event: EngineEvent) -> None:
        self._outbox.add(t, s.order, event)


def _steps_by(t0: float, d: float, until: float) -> int:
    """How many steps of ``d`` s from ``t0`` end at or before ``until``."""
    if until < t0 + d:
        return 0
    n = int((until - t0) / d)
    while t0 + (n + 1) * d <= until:
        n += 1
    while n > 0 and t0 + n * d > until:
        n -= 1
    return n
