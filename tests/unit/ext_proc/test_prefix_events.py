"""The precise prefix-cache index (ext_proc/prefix_events.py): KV events stored / removed / cleared,
parent chains, the bound, pending picks on an injected clock, the scorer on it, and agreement with a
simulated engine's own prefix cache under eviction."""

from __future__ import annotations

import random

import pytest

from ext_proc.prefix_choice import choose_cached, hit_shares
from ext_proc.prefix_events import EventIndex
from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored, EngineRequest
from sim.engines.kv import chain_hashes
from sim.engines.llm import LlmEngine

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BIG = 1_000


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def events_only() -> EventIndex:
    return EventIndex(pending_s=0.0, clock=Clock())


# --- events ---------------------------------------------------------------------------------------

def test_stored_blocks_match_as_a_run_of_leading_keys():
    index = events_only()
    index.stored(A, (1, 2, 3), None, BIG)
    assert index.matched((1, 2, 3, 4), [A, B]) == {A: 3}  # B holds nothing: absent
    assert index.matched((1, 2), [A]) == {A: 2}
    assert index.matched((9, 1, 2), [A]) == {}  # the first block differs: nothing reusable
    assert index.held(A) == 3 and index.held(B) == 0 and len(index) == 1
    assert hit_shares((1, 2, 3, 4), [A, B], index) == {A: 0.75}


def test_removed_blocks_shorten_the_match_tail_first_as_the_engine_evicts():
    index = events_only()
    index.stored(A, (1, 2, 3, 4), None, BIG)
    index.removed(A, (4, 3, 77))  # an unknown key is ignored
    assert index.matched((1, 2, 3, 4), [A]) == {A: 2}
    index.removed(A, (2,))
    assert index.matched((1, 2, 3, 4), [A]) == {A: 1} and index.held(A) == 1
    index.removed(A, (1,))
    assert index.matched((1, 2, 3, 4), [A]) == {} and len(index) == 0


def test_cleared_drops_one_endpoint_only():
    index = events_only()
    index.stored(A, (1, 2), None, BIG)
    index.stored(B, (1, 2), None, BIG)
    index.cleared(A)
    assert index.matched((1, 2), [A, B]) == {B: 2}
    index.cleared("10.9.9.9:8000")  # unknown: nothing happens
    assert len(index) == 1


def test_a_chain_continues_across_events_through_its_parent():
    index = events_only()
    index.stored(A, (1, 2), None, BIG)
    index.stored(A, (3, 4), 2, BIG)  # the next blocks of the same sequence, parent 2
    assert index.matched((1, 2, 3, 4, 5), [A]) == {A: 4}


def test_a_chain_whose_parent_is_missing_is_not_stored_so_the_index_stays_prefix_closed():
    index = events_only()
    index.stored(A, (1, 2), None, BIG)
    index.stored(A, (4, 5), 3, BIG)  # the event that stored 3 was lost
    assert index.held(A) == 2 and index.matched((1, 2, 3, 4, 5), [A]) == {A: 2}
    index.stored(A, (3,), 2, BIG)
    index.stored(A, (4, 5), 3, BIG)  # stored again (after an eviction): counted now
    assert index.matched((1, 2, 3, 4, 5), [A]) == {A: 5}
    index.stored(B, (7,), 6, BIG)  # nothing known of B: a chain starting mid-way is not stored
    assert index.held(B) == 0


def test_the_bound_forgets_the_longest_held_keys_first():
    index = events_only()
    index.stored(A, (1, 2, 3), None, 4)
    index.stored(A, (10, 11), None, 4)  # 5 keys for room for 4: removals were lost, 1 goes
    assert index.keys(A) == (2, 3, 10, 11)
    index.stored(A, (2,), None, 4)  # stored again: the freshest
    index.stored(A, (12,), None, 4)
    assert index.keys(A) == (10, 11, 2, 12)
    index.stored(B, (1, 2), None, 0)  # no room: nothing kept
    assert index.held(B) == 0 and len(index) == 1


# --- pending picks --------------------------------------------------------------------------------

def test_a_pick_counts_until_its_events_confirm_it_or_its_time_runs_out():
    clock = Clock()
    index = EventIndex(pending_s=2.0, clock=clock)
    index.insert(A, (1, 2, 3), BIG)
    assert index.matched((1, 2, 3), [A, B]) == {A: 3} and index.held(A) == 0 and index.pending(A) == 3
    assert index.last_sent(A) == 1 and index.last_sent(B) == 0
    index.stored(A, (1, 2), None, BIG)  # confirmed: held, no longer pending
    assert index.held(A) == 2 and index.pending(A) == 1
    clock.t = 2.5  # 3 was never confirmed (the engine had it already, or the request failed)
    assert index.matched((1, 2, 3), [A]) == {A: 2} and index.pending(A) == 0


def test_held_and_pending_keys_count_together():
    clock = Clock()
    index = EventIndex(pending_s=1.0, clock=clock)
    index.stored(A, (1, 2), None, BIG)
    index.insert(A, (1, 2, 3, 4), BIG)  # 3, 4 pending (1, 2 held already)
    assert index.pending(A) == 2 and index.matched((1, 2, 3, 4, 5), [A]) == {A: 4}
    index.stored(A, (3,), 2, BIG)  # the first chunk of its prefill was stored: 4 still pending
    assert index.pending(A) == 1 and index.held(A) == 3 and index.matched((1, 2, 3, 4, 5), [A]) == {A: 4}
    clock.t = 1.5
    assert index.matched((1, 2, 3, 4, 5), [A]) == {A: 3}


def test_removed_and_cleared_drop_pending_keys():
    clock = Clock()
    index = EventIndex(pending_s=5.0, clock=clock)
    index.insert(A, (1, 2, 3), BIG)
    index.removed(A, (3, 2))
    assert index.matched((1, 2, 3), [A]) == {A: 1} and index.pending(A) == 1
    index.cleared(A)
    assert index.matched((1, 2, 3), [A]) == {} and len(index) == 0


def test_pending_keys_are_bounded_and_off_with_pending_s_zero():
    clock = Clock()
    index = EventIndex(pending_s=5.0, clock=clock)
    index.insert(A, (1, 2, 3, 4), 2)
    assert index.pending(A) == 2
    off = events_only()
    off.insert(A, (1, 2, 3), BIG)
    assert off.matched((1, 2, 3), [A]) == {} and off.last_sent(A) == 1  # the turn still counts
    with pytest.raises(ValueError, match="pending_s"):
        EventIndex(pending_s=-1.0)


def test_retain_forgets_endpoints_that_left():
    index = EventIndex(pending_s=1.0, clock=Clock())
    index.stored(A, (1,), None, BIG)
    index.insert(B, (1, 2), BIG)
    index.retain([A])
    assert index.matched((1, 2), [A, B]) == {A: 1} and index.last_sent(B) == 0 and len(index) == 1


def test_the_prefix_choice_follows_the_events_not_the_picks():
    index = events_only()
    blocks = tuple(range(1, 11))
    index.insert(A, blocks, BIG)  # sent to A, whose engine then evicted it and stored it on B
    index.stored(B, blocks, None, BIG)
    endpoint, reason = choose_cached(blocks, [A, B], {}, {A: 0.5, B: 0.5}, index)
    assert (endpoint, reason) == (B, "affinity")


# --- against the simulated engine -----------------------------------------------------------------

def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(32000) for _ in range(n))


def _feed(index: EventIndex, events: list, capacity: int) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.stored(A, event.block_hashes, event.parent_block_hash, capacity)
        elif isinstance(event, BlockRemoved):
            index.removed(A, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.cleared(A)


def test_the_index_holds_what_the_engine_holds_through_evictions_and_a_reset():
    """Fed an ``llm`` engine's events, the index answers every probe as the engine's own prefix cache
    does (the leading blocks it would reuse), while prompts sharing prefixes fill and overflow it."""
    engine = LlmEngine("a10", kv_events=True)
    capacity = engine.spec.num_blocks
    index = events_only()
    shared = [_prompt(s, 800) for s in range(4)]
    sent: list[tuple[int, ...]] = []
    evicted = 0
    t = 0.0
    for i in range(60):
        p = shared[i % 4] + _prompt(100 + i, 400 + 37 * i)
        sent.append(p)
        engine.submit(EngineRequest(f"r{i}", p, 4, t), t)
        while (nxt := engine.next_event_s()) is not None and nxt <= t + 0.5:
            engine.advance(nxt)
        t += 0.5
        events = engine.drain_kv_events()
        evicted += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        _feed(index, events, capacity)
        for q in sent[-12:] + shared:
            keys = chain_hashes(q, 16)
            assert index.matched(keys, [A]).get(A, 0) == len(engine.prefix_users(keys))
    assert evicted > 0  # the cache did overflow
    while engine.next_event_s() is not None:
        engine.advance(engine.next_event_s())
    assert engine.reset_prefix_cache(t + 100)
    _feed(index, engine.drain_kv_events(), capacity)
    assert index.held(A) == 0


def test_a_7200_token_prompt_four_of_16_hold_in_part():
    """A 7 200-token prompt (450 keys of 16 tokens) whose first 6 000 tokens four of 16 endpoints hold:
    one match over the 16, and a pick's pending keys on a holder (the 75 it lacks) and elsewhere (450).
    What that costs: ``python3 -m bench.prefix_cost``."""
    rng = random.Random(7)
    keys = tuple(rng.getrandbits(63) for _ in range(450))
    endpoints = [f"10.0.0.{i}:8000" for i in range(16)]
    index = EventIndex(pending_s=2.0, clock=Clock())
    for i, e in enumerate(endpoints):
        index.stored(e, keys[:375] if i < 4 else tuple(rng.getrandbits(63) for _ in range(2000)), None, 30_000)
    assert index.matched(keys, endpoints) == {e: 375 for e in endpoints[:4]}
    index.insert(endpoints[0], keys, 30_000)
    index.insert(endpoints[5], keys, 30_000)
    assert index.matched(keys, endpoints) == {endpoints[0]: 450, **{e: 375 for e in endpoints[1:4]}, endpoints[5]: 450}
