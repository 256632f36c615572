"""The prefix choice (ext_proc/prefix_choice.py) on hand-made cases, and the picker using it: the body's
blocks, the index fed by commits, the config knob that turns it on."""

from __future__ import annotations

import json
from collections import Counter

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.body import body_fields
from ext_proc.handler import PickerHandler
from ext_proc.prefix_choice import HIT_WORTH, choose_cached, hit_shares
from ext_proc.prefix_index import PrefixIndex, block_hashes, prompt_bytes
from ext_proc.settings import from_wire, to_wire
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder
from inferlb.picker_config import picker_settings, routing_table
from tests.support.factories import config, service, version

FOUR = [f"10.0.0.{i}:8000" for i in range(4)]
EQUAL = {e: 0.25 for e in FOUR}


def keys(text: str) -> tuple[int, ...]:
    return block_hashes(text.encode())


SYSTEM = "s" * 4096  # 8 blocks
PROMPT = keys(SYSTEM + "q" * 1024)  # 10 blocks: 80 % of it is the shared system prompt


def cached_on(endpoint: str, prompt: tuple[int, ...] = PROMPT) -> PrefixIndex:
    index = PrefixIndex()
    index.insert(endpoint, prompt, 1000)
    return index


def loads_with(**extra: float) -> dict[str, float]:
    """Every endpoint at 10 requests, ``extra`` on top (by index: e2=3.0 is FOUR[2] at 13)."""
    return {e: 10.0 + extra.get(f"e{i}", 0.0) for i, e in enumerate(FOUR)}


def test_a_cached_prompt_stays_on_its_endpoint_while_its_extra_load_is_worth_less():
    """Mean load ~11.75 requests with this one: a whole hit is worth that many requests of imbalance."""
    index = cached_on(FOUR[2])
    assert choose_cached(PROMPT, FOUR, loads_with(e2=11.0), EQUAL, index) == (FOUR[2], "affinity")
    assert choose_cached(PROMPT, FOUR, loads_with(e2=20.0), EQUAL, index)[1] == "spilled"


def test_it_spills_when_the_extra_load_outweighs_the_cached_share():
    index = PrefixIndex()
    index.insert(FOUR[2], keys(SYSTEM), 1000)  # only the system prompt: 80 % of PROMPT
    endpoint, reason = choose_cached(PROMPT, FOUR, loads_with(e2=12.0, e1=1.0), EQUAL, index)
    assert reason == "spilled" and endpoint in (FOUR[0], FOUR[3])  # 0.8 x 14 = 11.2 < 12 requests above
    assert choose_cached(PROMPT, FOUR, loads_with(e2=9.0), EQUAL, index) == (FOUR[2], "affinity")


def test_at_low_load_a_hit_is_worth_at_least_the_floor():
    index = cached_on(FOUR[0])
    # two requests above the others, a mean load of 1.5: a whole hit is worth max(floor, 1.5)
    assert choose_cached(PROMPT, FOUR, {FOUR[0]: 2.0}, EQUAL, index, floor=3.0) == (FOUR[0], "affinity")
    assert choose_cached(PROMPT, FOUR, {FOUR[0]: 2.0}, EQUAL, index, floor=0.5)[1] == "spilled"


def test_the_longer_match_wins_between_two_cached_endpoints():
    index = PrefixIndex()
    index.insert(FOUR[0], keys(SYSTEM), 1000)
    index.insert(FOUR[1], PROMPT, 1000)
    assert hit_shares(PROMPT, FOUR, index) == {FOUR[0]: 0.8, FOUR[1]: 1.0}
    assert choose_cached(PROMPT, FOUR, loads_with(e1=1.0), EQUAL, index) == (FOUR[1], "affinity")


def test_weights_count_load_per_share():
    """Twice the weight carries twice the load for the same extra."""
    index = cached_on(FOUR[0])
    shares = {FOUR[0]: 0.4, FOUR[1]: 0.2, FOUR[2]: 0.2, FOUR[3]: 0.2}
    loads = {FOUR[0]: 40.0, FOUR[1]: 10.0, FOUR[2]: 10.0, FOUR[3]: 10.0}  # 40 on 0.4 is 25 per average share
    assert choose_cached(PROMPT, FOUR, loads, shares, index)[0] == FOUR[0]
    assert choose_cached(PROMPT, FOUR, loads, EQUAL, index)[1] == "spilled"


def test_cached_nowhere_takes_turns_among_the_not_overloaded():
    index = PrefixIndex()
    loads = loads_with(e3=30.0)  # more than the mean load above the others: out of turn
    sent = []
    for i in range(9):
        prompt = keys(f"{i:04d}" * 256)
        endpoint, reason = choose_cached(prompt, FOUR, loads, EQUAL, index)
        assert reason == "least-loaded"
        sent.append(endpoint)
        index.insert(endpoint, prompt, 1000)
    assert FOUR[3] not in sent
    assert len(set(sent[:3])) == 3 and Counter(sent) == Counter({FOUR[0]: 3, FOUR[1]: 3, FOUR[2]: 3})


def test_cached_nowhere_turns_follow_the_weights():
    index = PrefixIndex()
    shares = {FOUR[0]: 0.5, FOUR[1]: 0.25, FOUR[2]: 0.125, FOUR[3]: 0.125}
    sent = Counter()
    for i in range(800):
        prompt = keys(f"{i:05d}" * 205)
        endpoint, _ = choose_cached(prompt, FOUR, {}, shares, index)
        sent[endpoint] += 1
        index.insert(endpoint, prompt, 10)
    assert all(abs(sent[e] - 800 * shares[e]) <= 3 for e in FOUR), sent  # each turn a pick after its last


def test_a_conversations_next_turn_counts_what_its_latest_turns_endpoint_holds():
    """FOUR[2] served the conversation's latest turn, whose reply the index never saw: its engine
    holds 95 % of this prompt, though the index holds none of it anywhere."""
    nowhere, turn = PrefixIndex(), (FOUR[2], 0.95)
    loads = loads_with(e2=9.0)  # 9 requests above the others: a 95 % hit is worth 0.95 x 13.25
    assert choose_cached(PROMPT, FOUR, loads, EQUAL, nowhere)[1] == "least-loaded"
    assert choose_cached(PROMPT, FOUR, loads, EQUAL, nowhere, continued=turn) == (FOUR[2], "affinity")
    assert choose_cached(PROMPT, FOUR, loads_with(e2=14.0), EQUAL, nowhere, continued=turn)[1] == "spilled"
    # a share below what the index says it holds changes nothing
    index = cached_on(FOUR[2], keys(SYSTEM))
    assert (choose_cached(PROMPT, FOUR, loads, EQUAL, index, continued=(FOUR[2], 0.5))
            == choose_cached(PROMPT, FOUR, loads, EQUAL, index) == (FOUR[2], "affinity"))
    # an endpoint that may not take it (failing, no memory: not a candidate) is not chosen for it
    assert choose_cached(PROMPT, FOUR[:2], loads, EQUAL, nowhere, continued=turn)[0] in FOUR[:2]


def test_no_candidate_means_no_memory():
    assert choose_cached(PROMPT, [], {}, EQUAL, cached_on(FOUR[0])) == (None, "no-memory")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 50), min_size=4, max_size=4), st.sets(st.sampled_from(FOUR), max_size=4),
       st.floats(0.1, 3.0), st.floats(0, 8))
def test_the_choice_is_a_candidate_and_never_worse_than_the_least_loaded_by_more_than_a_hit(
        loads, cached, work, floor):
    index = PrefixIndex()
    for e in sorted(cached):
        index.insert(e, PROMPT, 1000)
    load = dict(zip(FOUR, loads, strict=True))
    endpoint, reason = choose_cached(PROMPT, FOUR, load, EQUAL, index, work, floor)
    assert endpoint in FOUR
    value = max(floor, HIT_WORTH * sum(x + work for x in loads) / 4)
    assert load[endpoint] <= min(loads) + value + 1e-9
    assert reason == ("least-loaded" if not cached else "affinity" if endpoint in cached else "spilled")
    assert choose_cached(PROMPT, FOUR, load, EQUAL, index, work, floor) == (endpoint, reason)


# --- the picker: body blocks, the index fed by commits, the knob ----------------------------------


def assignment(name: str, endpoints: list[str], max_concurrency: int = 8) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    locality = cla.endpoints.add()
    for address in endpoints:
        host, port = address.rsplit(":", 1)
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.metadata.filter_metadata["inferlb"].update({"max_concurrency": max_concurrency})
    return cla


def routing(tokens: int) -> RoutingTable:
    return RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity="soft"),),
                        body_max_bytes=1 << 20,
                        prefix_cache_tokens=tokens)


def body(user: str) -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": user}]}).encode()


def route(handler: PickerHandler, data: bytes, request_id: bytes) -> str:
    headers = {":authority": b"x", "content-type": b"application/json", "x-request-id": request_id}
    answer = handler.decide(headers, handler.holder.current, data, True, None, "request_headers")
    r = pb.ProcessingResponse.FromString(answer)
    sets = {o.header.key: o.header.raw_value for o in r.request_headers.response.header_mutation.set_headers}
    return sets["x-gateway-destination-endpoint"].decode()


def test_the_body_gives_the_prompt_blocks_only_with_the_index_on():
    data = body("q" * 1024)
    assert body_fields(data, routing(500_000)).blocks == block_hashes(prompt_bytes(json.loads(data)))
    assert body_fields(data, routing(0)).blocks == ()


def test_requests_sharing_a_system_prompt_follow_the_first_that_sent_it():
    handler = PickerHandler(ViewHolder(EndpointView.build({"c": assignment("c", FOUR)}, routing(500_000))))
    first = route(handler, body("first question " * 70), b"r0")
    assert handler.control.prefixes.held(first) == 10
    others = [route(handler, body(f"question {i} " * 80), b"r%d" % (i + 1)) for i in range(2)]
    # 80 % of the prompt cached there, worth 0.8 x min_bound (2) requests: one more in flight is
    # worth less and the second follows; two more are worth more and the third goes elsewhere
    assert others[0] == first and others[1] != first

    new = route(handler, json.dumps({"prompt": "z" * 5000}).encode(), b"r9")
    assert new != first  # cached nowhere: the least loaded's turn


def test_the_index_forgets_endpoints_that_left_the_view_only_after_keep_s():
    """A health flap (out of the view for a round) keeps the endpoint's keys: its KV cache is still there."""
    from ext_proc.inflight import InFlight
    from ext_proc.recent import KEEP_S

    now = [0.0]
    holder = ViewHolder(EndpointView.build({"c": assignment("c", FOUR)}, routing(500_000)))
    handler = PickerHandler(holder, InFlight(clock=lambda: now[0]))
    first = route(handler, body("q" * 2000), b"r0")
    held = handler.control.prefixes.held(first)
    handler.control.tick()
    holder.update({"c": assignment("c", [e for e in FOUR if e != first])}, routing(500_000))
    now[0] = KEEP_S
    handler.control.tick()
    assert handler.control.prefixes.held(first) == held > 0, "kept through a flap"
    holder.update({"c": assignment("c", FOUR)}, routing(500_000))
    now[0] = 2 * KEEP_S - 1
    handler.control.tick()   # back within KEEP_S: seen again now
    holder.update({"c": assignment("c", [e for e in FOUR if e != first])}, routing(500_000))
    now[0] = 3 * KEEP_S
    handler.control.tick()
    assert handler.control.prefixes.held(first) == 0 and len(handler.control.prefixes) == 0


def test_prefix_cache_tokens_reaches_the_picker_and_survives_the_wire():
    cfg = config([service("llm", [version("v1", 2)])])
    table = routing_table(cfg)
    assert table.prefix_cache_tokens == 500_000
    assert from_wire(to_wire(table, picker_settings(cfg)))[0].prefix_cache_tokens == 500_000
    off = config([service("llm", [version("v1", 2)])], picker={"prefix_cache_tokens": 0})
    assert routing_table(off).prefix_cache_tokens == 0


def chat_turns(n: int, opening: str) -> list[bytes]:
    """The bodies of a conversation's first ``n`` turns, each resending the ones before: a short
    opening (under one block), then long replies and short questions."""
    messages = [{"role": "system", "content": opening}, {"role": "user", "content": "hi"}]
    out = []
    for i in range(n):
        out.append(json.dumps({"messages": messages}).encode())
        messages = [*messages, {"role": "assistant", "content": f"reply {i} " * 150},
                    {"role": "user", "content": f"and {i}?"}]
    return out


def test_the_body_says_how_much_of_a_conversation_its_previous_turn_left_cached():
    first, second = chat_turns(2, "Conversation 7.")
    assert body_fields(first, routing(500_000)).continued == 0.0
    doc = json.loads(second)
    chars = sum(len(m["content"]) for m in doc["messages"])
    assert body_fields(second, routing(500_000)).continued == 1.0 - len("and 0?") / chars
    # not followed: a session key places it; the prefix key cut (a system prompt over
    # prefix_max_bytes: every conversation with it would share one key); the engines' keys
    # (their KV events see the replies); the index off
    keyed = json.dumps({**doc, "user": "u1"}).encode()
    assert body_fields(keyed, routing(500_000)).continued is None
    assert body_fields(second, routing(500_000), keyed=True).continued is None
    long_system = json.dumps({"messages": [{"role": "system", "content": "s" * 5000}, *doc["messages"][1:]]})
    assert body_fields(long_system.encode(), routing(500_000)).continued is None
    engine = RoutingTable(services=routing(500_000).services, body_max_bytes=1 << 20, prefix_cache_tokens=500_000,
                          engine_block_size=16)
    assert body_fields(second, engine).continued is None
    assert body_fields(second, routing(0)).continued is None


def test_a_conversations_turns_follow_it_though_its_opening_is_shorter_than_a_block():
    """Four conversations, each opened by a prompt of no full block (nothing in the index), each
    turn after it resending a long reply: every turn goes where the conversation's first went."""
    handler = PickerHandler(ViewHolder(EndpointView.build({"c": assignment("c", FOUR)}, routing(500_000))))
    conversations = [chat_turns(4, f"Conversation {c}.") for c in range(4)]
    where: dict[int, list[str]] = {c: [] for c in range(4)}
    for turn in range(4):
        for c, turns in enumerate(conversations):
            endpoint = route(handler, turns[turn], b"c%dt%d" % (c, turn))
            assert handler.control.inflight.completed("c", endpoint)  # one turn at a time: no load builds up
            where[c].append(endpoint)
    assert all(len(set(ws)) == 1 for ws in where.values()), where
    assert len({ws[0] for ws in where.values()}) > 1  # and they are not all on one endpoint
