"""The prefix-cache choice: an endpoint's cached share of the prompt against its extra load (pure).

For a request whose prompt blocks are known (:func:`ext_proc.prefix_index.block_hashes`) and that
no session pin decides, among the candidate endpoints (healthy, not failing):

- **Some candidate holds a prefix of the prompt.** Each gets one score, in typical requests::

      score = hit x value - (load + work) / share / n + min over the candidates of the same

  ``hit`` is the share of the prompt's blocks it already holds
  (:meth:`ext_proc.prefix_index.PrefixIndex.matched`, 0-1), the prefill it will not redo; the
  second part is how many typical requests more than the least loaded candidate it would run,
  counted on an average endpoint (``share`` its weight's share, ``n`` candidates; with equal
  weights, plain work in flight): the queued work the request joins. ``value`` is what a
  whole-prompt hit is worth in requests of imbalance: :data:`HIT_WORTH` times the candidates' mean
  load, at least ``floor`` (the scheduler's ``min_bound``). On a continuous-batching engine one
  more request in flight costs every request there a slightly longer decode step (A100,
  Llama-3.1-8B: ~18 us on a ~16.5 ms step, ENGINE-PHYSICS.md), while a miss prefills the whole
  prompt again (6 000 tokens: ~0.3 s on the same GPU) and stores a second copy of it, evicting
  another prompt's blocks; when the groups of a shared prefix get copies on several endpoints, the
  caches overflow and the engines preempt (the lab's ``shared_prefix`` at 72 QPS under the bounded
  loads of the ``bounded-load`` filter, then ``ext_proc/scheduler.py``: 17 % of the requests
  spilled, 4 661 preemptions in 200 virtual s, TTFT p90 9.3 s). The peers make the same trade:
  llm-d's default profile weighs its prefix scorer 3 against queue 2 and KV usage 2, SGLang's
  ``cache_aware`` keeps the cached worker until the load gap passes 64 requests and 1.5x. Scaled
  by the mean load, a whole-prompt hit stays until its endpoint runs an average endpoint's load
  more than the least loaded one, at any load, and an endpoint that slows down (its requests pile
  up) loses new prompts once its pile passes that. Tried and dropped: half the endpoint's max
  concurrency, which kept them on a slow endpoint longer (the lab's ``long_tail``, 16 A100s at 64
  QPS: TTFT p90 51.6 ms against 49.9 ms). The highest score wins (ties: the less loaded, then the
  rendezvous hash below).
- **A conversation's next turn.** The index holds the blocks of the prompts the picker sent, not
  the replies the engines generated and cached after them: a turn after a short prompt and a long
  reply found little or none of itself "cached" where its conversation's KV cache is, and went elsewhere
  (the lab's ``sharegpt_chat`` on 8 L4s at 16 QPS: 507 of 3 527 turns moved, 336 of them after a
  prompt under 100 tokens, shorter than a block; llm-d's picker moved 51). So the endpoint the
  conversation's latest turn went to counts as holding all of the prompt but its newest message
  (``continued``). With it: 69 turns moved, prefix hits 90.6 -> 94.1 %, TTFT p90 77.1 -> 74.2 ms
  (llm-d's 74.2 ms, 94.2 %); the full lab's figures are in docs/picker.md. The caller passes
  ``continued`` only where the profile's filters keep that endpoint (the ``prefix-cache`` plugin:
  an inferred hit stays within bounded-load's bound).
- **None holds any** (nothing shared, or a new prefix): among the candidates within ``value`` of
  the least loaded, the one most overdue for its weighted turn: the lowest
  ``last sent + 1 / share``, counted in prompts the index recorded (stride scheduling, as Envoy's
  weighted round robin). On a batching engine a new prompt's TTFT is set by the prefills that
  arrive beside it, not by how many requests decode there: in the lab's ``uniform`` at 144 QPS on
  16 A100s (120 virtual s), the least loaded endpoint gave TTFT p90 252-334 ms (a scan or two
  choices, by work or by requests in flight: consecutive prompts land together), a turn among the
  not overloaded 139 ms.

Ties between equal keys go to the highest rendezvous hash of the prompt's first block and the
endpoint, so pickers agree. Reasons, as the scheduler's: ``affinity`` (it went where the most of
its prompt is cached), ``spilled`` (more of it is cached elsewhere, but that endpoint was too
loaded), ``least-loaded`` (cached nowhere).

Deterministic: the same index, loads and request give the same answer in every process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from ext_proc.prefix_events import EventIndex
from ext_proc.prefix_index import PrefixIndex
from ext_proc.ring import key_hash

__all__ = ["HIT_WORTH", "choose_cached", "hit_shares", "rendezvous"]

#: A whole-prompt hit is worth this many times the candidates' mean load in requests of imbalance
#: (see the module docstring).
HIT_WORTH = 1.0

_M64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _endpoint_hash(endpoint: str) -> int:
    return key_hash(endpoint.encode())


def rendezvous(first: int, endpoint: str) -> int:
    """A 64-bit mix of the prompt's first block key and the endpoint (splitmix64's finalizer): the
    tie-break of the prefix choices, the same in every process."""
    x = (first ^ _endpoint_hash(endpoint)) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def hit_shares(blocks: Sequence[int], candidates: Sequence[str], index: PrefixIndex | EventIndex
               ) -> dict[str, float]:
    """``{endpoint: share of the prompt's blocks it holds}`` (0-1) for the candidates holding any (the
    prefix-cache scorer's score; missing: 0)."""
    n = len(blocks)
    if not n:
        return {}
    return {e: m / n for e, m in index.matched(blocks, candidates).items()}


def choose_cached(
    blocks: Sequence[int],
    candidates: Sequence[str],
    loads: Mapping[str, float],
    shares: Mapping[str, float],
    index: PrefixIndex | EventIndex,
    work: float = 1.0,
    floor: float = 2.0,
    worth: float = HIT_WORTH,
    continued: tuple[str, float] | None = None,
) -> tuple[str | None, str]:
    """Choose among ``candidates`` by cached prefix and load (see the module docstring).

    Args:
        blocks: the prompt's chained block keys (non-empty for a prefix to count).
        candidates: the endpoints that may take the request (healthy, not failing), in any order.
        loads: ``{endpoint: work in flight}`` (missing = 0; units of a typical request).
        shares: ``{endpoint: weight share}`` (> 0) of the candidates.
        index: the picker's prefix index (approximate, or fed by the engines' KV events:
            :class:`ext_proc.prefix_events.EventIndex`).
        work: this request's work (typical requests, > 0).
        floor: a whole-prompt hit is worth at least this many requests (the scheduler's
            ``min_bound``: at low load a prefix's next request, sent while the previous one runs,
            must not leave it).
        worth: what a whole-prompt hit is worth, in mean loads (:data:`HIT_WORTH`).
        continued: ``(endpoint, share)`` when the prompt continues a conversation whose latest
            turn went to ``endpoint`` (:meth:`PrefixIndex.turn_endpoint
            <ext_proc.prefix_index.PrefixIndex.turn_endpoint>`): its engine holds that turn's prompt
            and the reply it generated, so it holds at least ``share`` (0-1, the prompt before its
            newest message) whatever the index's blocks say.

    Returns:
        ``(endpoint, reason)``; ``(None, "no-memory")`` without candidates.
    """
    if not candidates:
        return None, "no-memory"
    n = len(candidates)
    rel = {e: (loads.get(e, 0.0) + work) / shares[e] / n for e in candidates}
    hits = hit_shares(blocks, candidates, index)
    if continued is not None:
        last, share = continued
        if share > hits.get(last, 0.0) and last in candidates:
            hits[last] = share
    first = blocks[0] if blocks else 0
    low = min(rel.values())
    value = max(floor, worth * sum(rel.values()) / n)
    if not hits:  # cached nowhere: the next in weighted turn among those within ``value`` of the least loaded
        due = index.last_sent
        best = min((e for e in candidates if rel[e] <= low + value),
                   key=lambda e: (due(e) + 1.0 / shares[e], -rendezvous(first, e)))
        return best, "least-loaded"
    best, best_key = None, None
    for e in candidates:
        key = (hits.get(e, 0.0) * value - rel[e] + low, -rel[e], rendezvous(first, e))
        if best_key is None or key > best_key:
            best, best_key = e, key
    return best, "affinity" if hits.get(best, 0.0) >= max(hits.values()) else "spilled"
