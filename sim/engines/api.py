"""The contract of a simulated inference engine: what goes in, what comes out, and when.

An engine is a pure state machine with **no clock of its own**: the caller owns time and tells the
engine what time it is. The real-time shell (:mod:`sim.node`) maps wall-clock time onto it; the
policy lab drives many engines in virtual time with no sockets and no sleeps. Both see exactly this
interface (:class:`Engine`), whatever the physics behind it (:mod:`sim.engines.llm`: continuous
batching as vLLM V1 schedules it; :mod:`sim.engines.job`: the seed's per-request GPU server).

Contract (times are floats in seconds of the caller's clock; every call carries ``now_s`` or
``until_s``, never earlier than the previous call's time, else ``ValueError``):

- :meth:`Engine.submit` ``(request, now_s)``: the request arrives at ``now_s``. The engine first
  runs everything due at or before ``now_s`` (its events are returned by the next ``advance``),
  then queues the request; it joins the engine's work at its next scheduling point (an ``llm``
  engine schedules between steps; an idle engine starts a step at once). A request the engine
  refuses outright (an ``llm`` prompt longer than the model's context, a ``job`` request whose
  declared memory does not fit) comes out as :class:`Failed` at ``now_s``.
- :meth:`Engine.next_event_s` ``-> float | None``: the time of the next thing the engine will do by
  itself (None: idle, nothing queued). It is never later than the next event ``advance`` would
  return; it may be an internal decision point at which ``advance`` returns no event (a prefill
  chunk, a preemption), so a caller that sleeps until it and calls ``advance`` misses nothing.
- :meth:`Engine.advance` ``(until_s) -> list[EngineEvent]``: run everything due at or before
  ``until_s``; return the events since the last call, in time order (ties: submission order).
  Per request: at most one :class:`FirstToken`, then :class:`Tokens`, then exactly one
  :class:`Finished` or :class:`Failed` (a cancelled request gets neither). The counts of its
  ``Tokens`` events sum to its output tokens minus the first. How often ``Tokens`` come depends on
  ``stream`` (constructor argument of the engines): streaming engines report each running
  request's new tokens at every ``advance`` call; the others report them once, before
  ``Finished`` (so the per-request cost of a long run does not grow with the batch).
- :meth:`Engine.cancel` ``(request_id, now_s)``: the client went away; the request's KV blocks or
  memory are released at the engine's next scheduling point. Unknown ids are ignored.
- :meth:`Engine.set_slow_factor` ``(factor, now_s)``: a slow GPU (a fault): ``llm``: steps that start
  after ``now_s`` take ``factor`` times longer; ``job``: requests that start after ``now_s``.
- :meth:`Engine.stats` ``-> EngineStats``: gauges and counters now (after the last call).
- :meth:`Engine.drain_kv_events` ``-> list[KvEvent]``: the KV-cache events since the last drain, in
  time order, as vLLM publishes them (``BlockStored`` with the block hashes and the parent hash,
  ``BlockRemoved``, ``AllBlocksCleared``); an engine without a prefix cache has none.

Determinism: the same calls with the same arguments give the same events and stats, bit for bit,
on any machine: no wall clock, no unseeded randomness, no iteration over hash-ordered sets, and
block keys are Python's ``hash`` of int tuples (independent of ``PYTHONHASHSEED``; the hash of a
``str`` is not, so no block key or ordering depends on one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

#: Why a request failed (:attr:`Failed.reason`).
FAIL_OOM = "oom"                 # job engine: its memory does not fit on the GPU (CUDA out of memory)
FAIL_TOO_LONG = "context_length"  # llm engine: prompt + output longer than the model's context


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One inference request as an engine sees it.

    ``request_id``: unique per engine. ``prompt``: the prompt's token ids (the KV cache and the
    prefix cache see these; at least one). ``output_tokens``: tokens to generate (>= 1).
    ``arrival_s``: when it arrived (s, the caller's clock; TTFT and end-to-end times count from
    here). ``memory_mib``: GPU memory the request declares (the ``job`` engine's explicit size,
    e.g. an image job; MiB; None = from its tokens; the ``llm`` engine ignores it).
    ``slowdown``: the simulator's long-tail fault: the request runs this many times slower
    (``job``: every time x ``slowdown``; ``llm``: it takes part in one step out of ``slowdown``,
    rounded; 1 = normal). ``block_keys``: the keys of the prompt's full blocks
    (:func:`sim.engines.kv.chain_hashes` at the engine's block size) when the caller has them, so a
    prompt sent many times is hashed once (the policy lab keeps them per prompt); None: the engine
    computes them.
    """

    request_id: str
    prompt: tuple[int, ...]
    output_tokens: int
    arrival_s: float
    memory_mib: float | None = None
    slowdown: float = 1.0
    block_keys: tuple[int, ...] | None = None
    output_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must have at least one token")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        if self.output_ids is not None and len(self.output_ids) != self.output_tokens:
            raise ValueError(f"output_ids must hold output_tokens ({self.output_tokens}) ids, "
                             f"got {len(self.output_ids)}")
        if self.memory_mib is not None and not self.memory_mib >= 0:
            raise ValueError(f"memory_mib must be >= 0, got {self.memory_mib}")
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")


# --- request events (advance) ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request's first output token came out at ``time_s`` (TTFT = ``time_s - arrival_s``);
    ``cached_tokens``: its prompt tokens found in the prefix cache (the prefill it skipped)."""

    request_id: str
    time_s: float
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Tokens:
    """``count`` more output tokens, the last at ``time_s``; ``itl_s``: their mean inter-token time
    (s: time since the request's previous token event / ``count``)."""

    request_id: str
    time_s: float
    count: int
    itl_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The request finished at ``time_s`` with all its ``output_tokens``.

    ``prompt_tokens``: its prompt; ``cached_tokens``: prompt tokens found cached when it was
    first scheduled; ``preemptions``: times it was preempted (its KV given back, recomputed later);
    ``queue_s``: arrival to first scheduled; ``first_token_s``: when its first token came out.
    """

    request_id: str
    time_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    queue_s: float
    first_token_s: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The request was refused or failed at ``time_s``: ``reason`` one of :data:`FAIL_OOM`,
    :data:`FAIL_TOO_LONG`; ``detail`` a message for humans (the HTTP error's text)."""

    request_id: str
    time_s: float
    reason: str
    detail: str


EngineEvent = FirstToken | Tokens | Finished | Failed


# --- KV-cache events (drain_kv_events), as vLLM's vllm/distributed/kv_events.py names them -------

@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full KV blocks entered the prefix cache at ``time_s``: their keys in order
    (``block_hashes``), the key of the block before the first (``parent_block_hash``, None for a
    prompt's first block), their ``token_ids`` (``block_size`` per block)."""

    time_s: float
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted at ``time_s`` (their memory reused)."""

    time_s: float
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped at ``time_s``."""

    time_s: float


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EngineStats(NamedTuple):
    """Gauges and counters of one engine (the values its ``/metrics`` shows; a named tuple: made at
    every scrape, and by the lab's oracle for every engine at every decision).

    Gauges: ``running`` (requests holding a running slot), ``waiting`` (queued), ``kv_usage``
    (0-1, vLLM's ``kv_cache_usage_perc``: blocks in use / all blocks; cached blocks no request uses
    count as free), ``kv_blocks_total``, ``kv_blocks_used``, GPU memory ``memory_total_mib``,
    ``memory_used_mib``, ``memory_free_mib`` (MiB, as DCGM shows them: an ``llm`` engine holds
    its whole ``gpu_memory_utilization`` share from the start). Counters since the start:
    ``prefix_queries`` / ``prefix_hits`` (prompt tokens looked up in / found in the prefix cache,
    first scheduling only, as vLLM counts them), ``preemptions``, ``finished``, ``failed``,
    ``prompt_tokens`` (prefilled, including recomputation), ``generation_tokens``.
    """

    running: int
    waiting: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_used: int
    memory_total_mib: float
    memory_used_mib: float
    memory_free_mib: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    finished: int
    failed: int
    prompt_tokens: int
    generation_tokens: int


class Engine(Protocol):
    """What every engine kind implements (see the module docstring for the contract)."""

    def submit(self, request: EngineRequest, now_s: float) -> None:
        """Queue ``request``, arrived at ``now_s`` (s). Raises ValueError on a duplicate id or a
        time earlier than the last call's."""

    def next_event_s(self) -> float | None:
        """When the engine next does something by itself (s), or None when idle."""

    def advance(self, until_s: float) -> list[EngineEvent]:
        """Run everything due at or before ``until_s`` (s); the events since the last call, in time order."""

    def cancel(self, request_id: str, now_s: float) -> None:
        """Drop ``request_id`` (the client left) at ``now_s``; no event follows for it."""

    def set_slow_factor(self, factor: float, now_s: float) -> None:
        """From ``now_s`` on, the GPU runs ``factor`` (> 0) times slower (1 = normal)."""

    def stats(self) -> EngineStats:
        """Gauges and counters now."""

    def drain_kv_events(self) -> list[KvEvent]:
        """The KV-cache events since the last drain, oldest first."""
