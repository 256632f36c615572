"""Each baseline's defining rule on a hand-made case (the lab's policies, no engines)."""

from __future__ import annotations

import random
from collections import Counter

from bench.lab.policies.least_request import LeastRequest
from bench.lab.policies.llm_d import LlmD, prompt_hashes
from bench.lab.policies.random_pick import RandomPick
from bench.lab.policies.ring_hash import RingHashBounded
from bench.lab.policies.round_robin import RoundRobin
from bench.lab.policies.sglang import RadixTree, SglangCacheAware, common_prefix
from bench.lab.policy import (
    KV_USAGE,
    WAITING,
    Context,
    Eds,
    Endpoint,
    Finished,
    FirstToken,
    Message,
    Prompt,
    Request,
    Route,
    Sample,
)

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


def _eds(weights: dict[str, int], health: dict[str, str] | None = None) -> Eds:
    eps = tuple(Endpoint(a, "chat-v1", w, (health or {}).get(a, "HEALTHY"), "a100") for a, w in sorted(weights.items()))
    return Eds(1, 0.0, {"chat-v1": eps}, {"v1": "chat-v1"}, "v1")


def _started(policy, eds: Eds, now: list[float] | None = None):
    clock = now or [0.0]
    policy.start(Context(clock=lambda: clock[0], rng=random.Random(7)))
    policy.on_eds(eds)
    return policy


def _request(i: int, text: str = "hello", headers: dict[str, bytes] | None = None) -> Request:
    tokens = tuple(ord(c) % 100 for c in text)
    return Request(i, 0.0, headers or {}, Prompt((Message("user", text, tokens),)), max_tokens=16)


def _routed(policy, request: Request) -> str:
    answer = policy.decide(request)
    assert isinstance(answer, Route)
    return answer.endpoint


def _finish(policy, request_id: int, endpoint: str) -> None:
    policy.on_progress([Finished(request_id, endpoint, 1.0, 200, 0.1, 1.0, 5, 16, 0)])


def test_random_picks_every_healthy_endpoint_and_no_unhealthy_one() -> None:
    p = _started(RandomPick(), _eds({A: 1, B: 1, C: 1}, {C: "UNHEALTHY"}))
    seen = Counter(_routed(p, _request(i)) for i in range(300))
    assert set(seen) == {A, B}
    assert 100 < seen[A] < 200


def test_round_robin_rotates_with_equal_weights_and_follows_unequal_ones() -> None:
    p = _started(RoundRobin(), _eds({A: 1, B: 1, C: 1}))
    first = [_routed(p, _request(i)) for i in range(6)]
    assert first[:3] == first[3:] and sorted(first[:3]) == [A, B, C]
    p = _started(RoundRobin(), _eds({A: 3, B: 1}))
    assert Counter(_routed(p, _request(i)) for i in range(40)) == {A: 30, B: 10}


def test_least_request_two_choices_prefer_the_idle_endpoint() -> None:
    p = _started(LeastRequest(), _eds({A: 1, B: 1}))
    wins = 0
    for i in range(400):
        p.active = {A: 3}  # A has 3 requests in flight, B none: B wins when one of the two draws is B (3 in 4)
        wins += _routed(p, _request(i)) == B
    assert 260 < wins < 340, wins


def test_least_request_unequal_weights_divide_by_active_requests_plus_one() -> None:
    p = _started(LeastRequest(), _eds({A: 2, B: 1}))
    picks: Counter[str] = Counter()
    for i in range(60):
        p.active = {A: 3}  # A: 2 / (3 + 1) = 0.5 against B: 1 / (0 + 1) = 1
        picks[_routed(p, _request(i))] += 1
    assert 35 <= picks[B] <= 45 and picks[A] + picks[B] == 60, picks
    p = _started(LeastRequest(), _eds({A: 2, B: 1}))
    idle = Counter(_routed(p, _request(i)) for i in range(60) if not p.active.clear())
    assert idle == {A: 40, B: 20}  # no load: the plain weights


def test_ring_hash_keeps_a_session_and_moves_it_only_past_its_slots() -> None:
    p = _started(RingHashBounded(hash_balance_factor=150), _eds({A: 1, B: 1, C: 1, D: 1}))
    key = {"x-session-id": b"user-42"}
    home = _routed(p, _request(1, headers=key))
    # with k of the cluster's requests in flight (all on home), slots = ceil(ceil((k + 1) x 150 / 100) x 1/4):
    # k = 1: 1 slot, home holds 1 -> stays; k = 2: 2 slots, holds 2 -> stays
    assert [_routed(p, _request(i, headers=key)) for i in (2, 3)] == [home, home]
    # k = 3: 2 slots and home holds 3: overloaded, the hash-seeded probe moves the request
    moved = _routed(p, _request(4, headers=key))
    assert moved != home
    for i in (1, 2, 3, 4):
        _finish(p, i, p.routed[i][0])
    assert _routed(p, _request(5, headers=key)) == home  # the load is gone: home again
    # without the session header there is no hash: a random endpoint
    assert len({_routed(p, _request(10 + i)) for i in range(40)}) > 1


def test_llm_d_prefix_scorer_keeps_a_prompt_where_it_was_sent_and_the_queue_scorer_spreads() -> None:
    p = _started(LlmD(), _eds({A: 1, B: 1, C: 1}))
    text = "s" * 2000
    first = _routed(p, _request(1, text))
    assert all(_routed(p, _request(i, text)) == first for i in range(2, 6))
    # a prompt with no history: the queue scorer prefers the endpoint with the shortest waiting queue
    p.on_samples([Sample(A, 0.0, {WAITING: 5.0, KV_USAGE: 0.5}), Sample(B, 0.0, {WAITING: 0.0, KV_USAGE: 0.5}),
                  Sample(C, 0.0, {WAITING: 9.0, KV_USAGE: 0.5})])
    assert _routed(p, _request(7, "q" * 2000)) == B
    assert len(prompt_hashes(_request(8, "x" * 10), 16)) == 0  # shorter than one 64-character block


def test_llm_d_prompt_hashes_are_their_chain_of_the_whole_prompt_when_a_start_is_reused() -> None:
    """A chat's turns and a group's prompts share their start: the hashes reused from an earlier prompt and
    those made anew are the chain of the whole prompt's bytes, cut at max_blocks (theirs: a hash seeded
    with the model, each 64-character block hashed with the digest before it, a partial last block included)."""
    import hashlib

    import orjson

    def h(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=8).digest()

    def chain(messages: tuple[Message, ...], model: str, max_blocks: int) -> tuple[bytes, ...]:
        data = orjson.dumps([{"role": m.role, "content": m.text} for m in messages])[:max_blocks * 64]
        prev, out = h(model.encode()), []
        for i in range(0, len(data), 64):
            prev = h(data[i:i + 64] + prev)
            out.append(prev)
        return tuple(out) if len(data) >= 64 else ()

    system = Message("system", "s" * 700, (1,))
    for extra in range(64):  # every length modulo the block: some turns end on a block's end
        messages: tuple[Message, ...] = (system,)
        for turn in range(4):
            messages = (*messages, Message("user", f"q{turn}" * (10 + extra), (2,)))
            for model, cap in (("m", 256), ("", 20)):
                for prompt in (messages, (system, Message("user", "z" * extra, (3,)))):
                    request = Request(turn, 0.0, {}, Prompt(prompt), model=model or None)
                    assert prompt_hashes(request, 16, cap) == chain(prompt, model, cap)
            messages = (*messages, Message("assistant", "a" * (50 + turn), (4,)))


def test_llm_d_weights_prefix_3_against_queue_2_and_kv_2() -> None:
    p = _started(LlmD(), _eds({A: 1, B: 1}))
    text = "t" * 4000
    home = _routed(p, _request(1, text))
    other = B if home == A else A
    # home: full prefix (3) + longest queue (0) + full KV (0) = 3; other: 0 + 2 + 2 = 4 -> other
    p.on_samples([Sample(home, 0.0, {WAITING: 9.0, KV_USAGE: 1.0}), Sample(other, 0.0, {WAITING: 0.0, KV_USAGE: 0.0})])
    assert _routed(p, _request(2, text)) == other


def test_sglang_tree_matches_the_longest_prefix_and_counts_characters_per_worker() -> None:
    tree = RadixTree()
    tree.insert("hello world", A, 1.0)
    tree.insert("hello there", B, 2.0)
    assert tree.prefix_match("hello world, again", 3.0) == (11, A)
    assert tree.prefix_match("hello th", 3.0) == (8, B)
    assert tree.chars == {A: 11, B: 11}
    assert tree.smallest([A, B, C]) == C
    assert common_prefix("abcdef", "xxabcxyz", 2) == 3


def test_sglang_switches_to_the_shortest_queue_above_its_thresholds() -> None:
    p = _started(SglangCacheAware(), _eds({A: 1, B: 1}))
    text = "shared system prompt " * 20
    home = _routed(p, _request(1, text))
    other = B if home == A else A
    assert _routed(p, _request(2, text)) == home  # balanced: the best prefix match (rate > 0.3)
    # imbalanced: max - min > 64 and max > 1.5 x min -> the shortest queue, whatever the cache
    p.active = {home: 100, other: 10}
    assert _routed(p, _request(3, text)) == other
    # below the absolute threshold (100 - 40 = 60 <= 64): back to the cache
    p.active = {home: 100, other: 40}
    assert _routed(p, _request(4, text)) == home
    assert p.imbalanced([100, 10]) and not p.imbalanced([100, 40]) and not p.imbalanced([60, 5])


def test_sglang_sends_a_miss_to_the_worker_with_the_smallest_tree() -> None:
    p = _started(SglangCacheAware(), _eds({A: 1, B: 1}))
    first = _routed(p, _request(1, "a" * 500))
    second = _routed(p, _request(2, "b" * 100))  # matches nothing: the smaller tree
    assert second != first
    third = _routed(p, _request(3, "c" * 50))
    assert third == second  # 100 characters against 500


def test_dynamo_cost_is_overlap_weight_times_uncached_prefill_plus_active_decode_blocks() -> None:
    from bench.lab.policies.dynamo import DynamoKv
    from bench.lab.policy import KvEvents
    from bench.lab.workloads.tokens import prompt_keys
    from sim.engines.api import BlockStored

    p = _started(DynamoKv(), _eds({A: 1, B: 1}))
    request = Request(1, 0.0, {}, Prompt((Message("user", "x" * 64, tuple(range(64))),)))  # 4 blocks of 16
    keys = prompt_keys(request.prompt, 16)
    p.on_kv_events([KvEvents(A, 0.0, [BlockStored(0.0, keys, None, tuple(range(64)), 16)])])
    assert p.overlap(keys, A) == 4 and p.overlap(keys, B) == 0
    # A: prefill 0 + decode (active + 4); B: prefill 64 / 16 = 4 + decode (0 + 4) = 8
    p.decode_blocks = {A: 2}  # A: 6 < 8
    assert _routed(p, request) == A
    p.decode_blocks = {A: 5}  # A: 9 > 8
    assert _routed(p, Request(2, 0.0, {}, request.prompt)) == B
    # the first token ends the request's prefill load; the end ends its decode blocks
    assert p.prefill_tokens[B] == 64 and p.decode_blocks[B] == 4
    p.on_progress([FirstToken(2, B, 0.5, 0)])
    assert p.prefill_tokens[B] == 0
    _finish(p, 2, B)
    assert p.decode_blocks[B] == 0


def test_the_cli_names_every_scenario_and_policy_of_the_registries() -> None:
    from bench.lab.cli import DEFAULT_POLICY_NAMES
    from bench.lab.cli import POLICY_NAMES as CLI_POLICIES
    from bench.lab.cli import SCENARIO_NAMES as CLI_SCENARIOS
    from bench.lab.policies import POLICY_NAMES
    from bench.lab.scenarios import SCENARIOS

    assert CLI_POLICIES == POLICY_NAMES
    assert set(CLI_POLICIES) - set(DEFAULT_POLICY_NAMES) == {"inferlb_precise", "inferlb_latency"}
    assert CLI_SCENARIOS == tuple(SCENARIOS)


def test_the_oracle_prices_the_cached_blocks_a_miss_evicts_and_follows_a_cached_prefix() -> None:
    from bench.lab.policies.oracle import Oracle
    from sim.engines.api import EngineRequest
    from sim.engines.llm import LlmEngine

    engines = {A: LlmEngine("a10"), B: LlmEngine("a10")}  # 1 838 blocks of 16 tokens each
    cached = tuple(random.Random(1).randrange(32000) for _ in range(1500 * 16))
    engines[B].submit(EngineRequest("warm", cached, 1, 0.0), 0.0)
    while (t := engines[B].next_event_s()) is not None:
        engines[B].advance(t)
    assert engines[B].idle_cached_blocks == 1500  # B holds a prefix no request uses; 338 blocks hold nothing
    clock = [100.0]
    p = Oracle()
    p.start(Context(clock=lambda: clock[0], rng=random.Random(7), engines=engines))
    p.on_eds(_eds({A: 1, B: 1}))
    p.came_back, p.gone = 9.0, 1.0  # evicted blocks mostly come back: an eviction costs their prefill again

    def request(i: int, tokens: tuple[int, ...]) -> Request:
        return Request(i, clock[0], {}, Prompt((Message("user", "x", tokens),)), max_tokens=16)

    other = tuple(random.Random(2).randrange(32000) for _ in range(400 * 16))  # 401 blocks with its output
    assert _routed(p, request(1, other)) == A  # on B it would evict 63 cached blocks; on A none
    assert _routed(p, request(2, cached[:1400 * 16] + other[:16])) == B  # its prefix is cached on B
