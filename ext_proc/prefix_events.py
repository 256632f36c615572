"""The precise prefix-cache index: which KV blocks each endpoint holds, per its KV-cache events (pure).

The approximate index (:class:`ext_proc.prefix_index.PrefixIndex`) learns only from the picker's own
routing, so it cannot see what an engine evicted under KV pressure, dropped on a reset, or was sent
by another gateway. An engine that publishes its KV-cache events tells exactly that: vLLM's
``KVEventBatch`` (``vllm/distributed/kv_events.py``, over ZMQ, msgpack-encoded) carries

- ``BlockStored``: full blocks that entered its prefix cache, their hashes in order and the hash of
  the block before the first (``parent_block_hash``; none at a prompt's start);
- ``BlockRemoved``: blocks evicted (their memory reused);
- ``AllBlocksCleared``: the whole prefix cache dropped (``reset_prefix_cache``).

A consumer that applies them in order holds each engine's cached blocks, as llm-d's KV-cache indexer
does for its precise prefix scorer (``llm-d-kv-cache``: the router tokenizes the prompt with the
model's tokenizer and computes vLLM's block hashes itself, so a request's keys are the engine's) and
as NVIDIA Dynamo's KV router does. :class:`EventIndex` is that view per endpoint, with the query
interface of :class:`~ext_proc.prefix_index.PrefixIndex`, so the ``prefix-cache`` scorer and
:func:`ext_proc.prefix_choice.choose_cached` use either unchanged.

- **Keys.** A request's blocks must be keyed as the engine keys them (its tokenizer, its block size,
  its chained hash: block ``i``'s key covers tokens ``0..(i + 1) x block_size``); the caller computes
  them (:attr:`ext_proc.picker.BodyFields.blocks`).
- **Match.** :meth:`EventIndex.matched` gives the run of the prompt's leading keys the endpoint
  holds (the engine reuses only that), by binary search: an engine's cached blocks are
  *prefix-closed* along every chain, as vLLM frees a request's blocks tail first and evicts the
  least recently freed first, so a block's parent is evicted after it (a shared prefix, used again,
  is fresher still). The index keeps it so: a ``BlockStored`` whose parent it does not hold (an
  event lost) is not applied, so it under-counts that chain, never over-counts, until the engine
  stores it again. ~9 dictionary reads for a 6 000-token prompt's 375 keys, against ~40 µs for a
  walk key by key.
- **Pending keys.** Events arrive after the prompt's prefill is scheduled plus the publisher's trip:
  between a pick and its ``BlockStored`` the events say nothing of the prompt, and a burst of requests
  sharing a new prefix would be spread over every endpoint. :meth:`EventIndex.insert` (the picker's
  own pick) records the prompt's keys the endpoint does not hold as *pending* for ``pending_s``
  seconds of the injected clock; a ``BlockStored`` of a key makes it held, a ``BlockRemoved`` or
  ``AllBlocksCleared`` drops it, and a key no event confirmed in time is forgotten (the request
  failed, was sent elsewhere by a retry, or the engine already held it: vLLM publishes only newly
  stored blocks). ``pending_s`` 0: events alone (llm-d's precise scorer as documented).
- **Bound.** Each endpoint holds at most ``capacity`` keys (:meth:`EventIndex.stored`'s argument:
  what its KV cache holds, in blocks): the engine's own removals keep the set within it, so the bound
  only acts when removals were lost (a dropped event, a publisher restart), and then forgets the
  longest-held keys first. Pending keys are bounded likewise by :meth:`EventIndex.insert`'s.

Not thread-safe: one owner applies events and answers queries (the picker's event loop; a
subscriber thread hands it whole batches). Deterministic: the same calls at the same clock readings
give the same state and answers.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

__all__ = ["PENDING_S", "RECENT_PROMPTS", "EventIndex"]

#: How long a picked prompt's keys count as held on its endpoint before its events confirm them (s):
#: its wait in the engine's queue, its prefill's first chunk, and the event publisher's trip. The lab
#: (docs/picker.md, "Prefix-cache index"): ``shared_prefix`` on 4 A100s at 24 QPS, a cold start whose
#: queues last seconds: 2 s gave TTFT p90 279 ms, 5 s and 10 s 131.5 ms (the approximate index's).
PENDING_S = 5.0


#: How many of the prompts last sent to an endpoint the index remembers (:meth:`EventIndex.recent`).
RECENT_PROMPTS = 8

_NONE: Mapping[int, None] = {}


def _held_or_pending(held: Mapping[int, object], pending: Mapping[int, float], now: float, key: int) -> bool:
    """``key`` is held, or pending and its time has not run out at ``now``."""
    return key in held or pending.get(key, 0.0) > now


def _leading(keys: Sequence[int], held: Callable[[int], bool]) -> int:
    """How many leading ``keys`` ``held`` accepts, assuming it accepts a prefix of them (a binary search)."""
    last = len(keys) - 1
    if last < 0 or not held(keys[0]):
        return 0
    if held(keys[last]):
        return last + 1
    lo, hi = 0, last  # keys[lo] held, keys[hi] not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if held(keys[mid]):
            lo = mid
        else:
            hi = mid
    return lo + 1


class EventIndex:
    """Per endpoint, the KV block keys its events say it holds, and the keys it was just sent (see the
    module docstring).

    Args:
        pending_s: how long a sent prompt's keys count as held before events confirm them (s, >= 0;
            0: never).
        clock: the clock pending keys expire on (s; monotonic).

    Raises:
        ValueError: ``pending_s`` < 0.

    Memory: one dictionary entry per held or pending key, at most the endpoints' capacities, and
    references to the last :data:`RECENT_PROMPTS` prompts' keys per endpoint.
    """

    __slots__ = ("_clock", "_held", "_last", "_pending", "_pending_s", "_recent", "_seq", "_sweep_at")

    def __init__(self, pending_s: float = PENDING_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not pending_s >= 0:
            raise ValueError(f"pending_s must be >= 0, got {pending_s}")
        self._pending_s = pending_s
        self._clock = clock
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._pending: dict[str, dict[int, float]] = {}  # key -> when it stops counting
        self._sweep_at = 0.0
        self._last: dict[str, int] = {}
        self._seq = 0
        self._recent: dict[str, deque[Sequence[int]]] = {}

    # --- the engines' events ------------------------------------------------------------------------

    def stored(self, endpoint: str, keys: Sequence[int], parent: int | None, capacity: int) -> None:
        """``endpoint``'s ``BlockStored``: ``keys`` (in chain order; ``parent`` the key before the
        first, None at a prompt's start) entered its prefix cache; then its longest-held keys go until
        it holds at most ``capacity`` (<= 0: nothing is kept for it).

        A chain whose ``parent`` the index does not hold (its event was lost, or the bound forgot it)
        is not stored: the index stays prefix-closed, so a match never counts blocks past one it
        lacks; it under-counts that chain until the engine stores its blocks again."""
        held = self._held.get(endpoint)
        if parent is not None and (held is None or parent not in held):
            return
        pending = self._pending.get(endpoint)
        if pending:
            for key in keys:
                pending.pop(key, None)
        if held is None:
            if capacity <= 0 or not keys:
                return
            held = self._held[endpoint] = OrderedDict()
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > capacity:
            held.popitem(last=False)
        if not held:
            del self._held[endpoint]

    def removed(self, endpoint: str, keys: Iterable[int]) -> None:
        """``endpoint``'s ``BlockRemoved``: it evicted ``keys`` (held or pending; unknown keys are ignored)."""
        held, pending = self._held.get(endpoint), self._pending.get(endpoint)
        for key in keys:
            if held is not None:
                held.pop(key, None)
            if pending is not None:
                pending.pop(key, None)
        if held is not None and not held:
            del self._held[endpoint]

    def cleared(self, endpoint: str) -> None:
        """``endpoint``'s ``AllBlocksCleared``: it holds nothing (its pending keys go too: a prompt sent
        before the reset finds nothing cached either)."""
        self._held.pop(endpoint, None)
        self._pending.pop(endpoint, None)

    # --- the picker's own picks ---------------------------------------------------------------------

    def insert(self, endpoint: str, blocks: Sequence[int], capacity: int) -> None:
        """Record that ``endpoint`` was sent a prompt of keys ``blocks`` (the request control's call, as for
        :meth:`PrefixIndex.insert`): it counts for :meth:`last_sent`, and the keys it does not hold
        are pending until ``pending_s`` from now, at most ``capacity`` of them (expired ones go
        first, then the first recorded); it is one of the endpoint's :meth:`recent` prompts."""
        self._seq += 1
        self._last[endpoint] = self._seq
        if blocks:
            recent = self._recent.get(endpoint)
            if recent is None:
                recent = self._recent[endpoint] = deque(maxlen=RECENT_PROMPTS)
            recent.append(blocks)
        if not self._pending_s or capacity <= 0 or not blocks:
            return
        held = self._held.get(endpoint)
        start = 0 if held is None else _leading(blocks, held.__contains__)
        if start == len(blocks):
            return
        now = self._clock()
        pending = self._pending.get(endpoint)
        if pending is None:
            pending = self._pending[endpoint] = {}
        pending.update(dict.fromkeys(blocks[start:], now + self._pending_s))  # in C
        if len(pending) > capacity:
            pending = self._pending[endpoint] = {k: u for k, u in pending.items() if u > now}
            while len(pending) > capacity:
                del pending[next(iter(pending))]

    def _sweep(self, now: float) -> None:
        """Forget the pending keys whose time ran out, at most once per ``pending_s`` (until then an
        expired key stays in its table, and queries check its time)."""
        if now < self._sweep_at:
            return
        self._sweep_at = now + self._pending_s
        for endpoint, pending in list(self._pending.items()):
            kept = {k: u for k, u in pending.items() if u > now}
            if kept:
                self._pending[endpoint] = kept
            else:
                del self._pending[endpoint]

    # --- queries ------------------------------------------------------------------------------------

    def matched(self, blocks: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """``{endpoint: leading blocks of blocks it holds or was just sent}`` for those of
        ``endpoints`` that hold at least the first (missing: 0)."""
        out: dict[str, int] = {}
        if not blocks:
            return out
        first = blocks[0]
        now = 0.0
        if self._pending:
            now = self._clock()
            self._sweep(now)
        for e in endpoints:
            held, pending = self._held.get(e), self._pending.get(e)
            if pending is None:
                if held is None or first not in held:
                    continue
                out[e] = _leading(blocks, held.__contains__)
            else:
                has = partial(_held_or_pending, held or _NONE, pending, now)
                if has(first):
                    out[e] = _leading(blocks, has)
        return out

    def recent(self, endpoint: str) -> Sequence[Sequence[int]]:
        """The keys of the last :data:`RECENT_PROMPTS` prompts sent to ``endpoint``, oldest first
        (:meth:`ext_proc.own_keys.OwnKeys.resolve` finds an unknown parent among them)."""
        return self._recent.get(endpoint, ())

    def last_sent(self, endpoint: str) -> int:
        """The insert count when ``endpoint`` was last sent a prompt (0: never)."""
        return self._last.get(endpoint, 0)

    def held(self, endpoint: str) -> int:
        """How many keys ``endpoint``'s events say it holds (pending keys not counted)."""
        held = self._held.get(endpoint)
        return 0 if held is None else len(held)

    def pending(self, endpoint: str) -> int:
        """How many of ``endpoint``'s keys are pending (expired ones counted until a sweep)."""
        pending = self._pending.get(endpoint)
        return 0 if pending is None else len(pending)

    def keys(self, endpoint: str) -> tuple[int, ...]:
        """``endpoint``'s held keys, longest held first (for tests and the admin API)."""
        return tuple(self._held.get(endpoint, ()))

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in ``endpoints`` (it left the view)."""
        keep = set(endpoints)
        for table in (self._held, self._pending, self._last, self._recent):
            for e in [e for e in table if e not in keep]:
                del table[e]

    def __len__(self) -> int:
        """Endpoints with at least one held or pending key."""
        return len(self._held.keys() | self._pending.keys())
