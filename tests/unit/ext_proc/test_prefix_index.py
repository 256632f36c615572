"""The prefix-cache index (ext_proc/prefix_index.py): blocks and chained keys, the LRU bound, the
eviction order (tails first), the longest match, determinism across processes, and its cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc import _wire  # built by pip install / scripts/setup.sh
from ext_proc.body import prefix_hash
from ext_proc.prefix_index import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    PrefixIndex,
    block_hashes,
    block_hashes_py,
    capacity_blocks,
    message_text,
    prompt_bytes,
    prompt_keys,
    prompt_keys_py,
    prompt_of,
)
from ext_proc.ring import key_hash

ROOT = Path(__file__).resolve().parents[3]


def chat(*messages: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in messages]}


# --- blocks and keys ------------------------------------------------------------------------------


def test_prompt_bytes_reads_chat_parts_and_completions_alike():
    assert prompt_bytes(chat(("system", "be brief"), ("user", "hi"))) == b"system\x1fbe brief\x1euser\x1fhi\x1e"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                                       {"type": "text", "text": "b"}]}]}
    assert prompt_bytes(parts) == b"user\x1fab\x1e"
    assert prompt_bytes({"prompt": "once upon"}) == b"once upon"
    assert prompt_bytes({"prompt": ["first", "second"]}) == b"first"
    assert prompt_bytes({"model": "m"}) == b"" and prompt_bytes({"messages": "nope"}) == b""


def test_json_spacing_and_key_order_do_not_change_the_keys():
    doc = chat(("system", "s" * 3000), ("user", "q" * 700))
    spaced = json.loads(json.dumps(doc, indent=3, sort_keys=True))
    assert block_hashes(prompt_bytes(doc)) == block_hashes(prompt_bytes(spaced))
    assert len(block_hashes(prompt_bytes(doc))) == len(prompt_bytes(doc)) // BLOCK_BYTES


def test_only_full_blocks_count_and_at_most_max_blocks():
    assert block_hashes(b"x" * (BLOCK_BYTES - 1)) == ()
    assert len(block_hashes(b"x" * (BLOCK_BYTES * 3 + 7))) == 3
    assert len(block_hashes(b"x" * BLOCK_BYTES * (MAX_BLOCKS + 5))) == MAX_BLOCKS
    with pytest.raises(ValueError):
        block_hashes(b"abc", block_bytes=0)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=3000), st.binary(min_size=1, max_size=2000), st.binary(min_size=1, max_size=2000),
       st.integers(1, 300))
def test_key_i_covers_exactly_blocks_0_to_i(shared, tail_a, tail_b, block):
    """Two prompts share key i iff their first i + 1 blocks are equal (no collision in these draws)."""
    a, b = shared + tail_a, shared + tail_b
    ka, kb = block_hashes(a, block, 10_000), block_hashes(b, block, 10_000)
    for i in range(min(len(ka), len(kb))):
        same = a[:(i + 1) * block] == b[:(i + 1) * block]
        assert (ka[i] == kb[i]) == same


def test_the_picker_uses_the_compiled_block_keys_here():
    """scripts/setup.sh (pip install) builds ext_proc._wire on this kind of machine."""
    data = bytes(range(256)) * 9
    assert block_hashes(data) == _wire.block_keys(data, BLOCK_BYTES, MAX_BLOCKS) == block_hashes_py(data)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=5000), st.integers(0, 40_000).map(lambda n: b"\xff" * n),
                 st.integers(0, 40_000).map(lambda n: bytes(range(256)) * (n // 256))),
       st.sampled_from([1, 3, 15, 16, 17, 63, 64, 65, 127, 512, 513, 5552, 5553, 12_000]),
       st.sampled_from([-1, 0, 1, 2, 7, MAX_BLOCKS, 100_000]), st.booleans())
def test_compiled_keys_are_zlibs_crc32_and_adler32_chained(data, block, max_blocks, simd):
    """The compiled keys (vector CRC-32 and Adler-32, or the portable C ones) equal the reference in
    Python over zlib: every length around the 16- and 64-byte steps, and bytes of 0xFF (the largest
    sums, for Adler-32's overflow bound of 5 552 bytes)."""
    assert _wire.block_keys(data, block, max(0, max_blocks), simd) == block_hashes_py(data, block, max_blocks)
    assert block_hashes(data, block, max_blocks) == block_hashes_py(data, block, max_blocks)


def test_compiled_keys_refuse_what_the_reference_refuses():
    for fn in (block_hashes, block_hashes_py):
        with pytest.raises(ValueError):
            fn(b"abc", block_bytes=0)
    with pytest.raises(TypeError):
        _wire.block_keys("text", 4, 1)


def _prompt_chars(doc: dict) -> int | None:
    """The handler's prompt length before prompt_of (frozen copy): its reference."""
    chat = doc.get("messages")
    if isinstance(chat, list):
        return sum(len(message_text(m.get("content"))) for m in chat if isinstance(m, dict))
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return None


_texts = st.one_of(st.text(max_size=300), st.text(alphabet="ab ", max_size=3000),
                   st.text(alphabet=st.characters(min_codepoint=0x80), max_size=800),
                   st.sampled_from(["\ud800 lone", "é☃" * 900, ""]))
_contents = st.one_of(_texts, st.none(), st.integers(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _texts}), st.just({"type": "image_url"}),
    st.just({"text": 5}), st.just("bare")), max_size=4))
_messages = st.lists(st.one_of(st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(
    ["system", "user", "assistant", "tool"]), st.none(), st.integers()), "content": _contents}), st.just("x"),
    st.just(3)), max_size=6)
_bodies = st.one_of(
    st.fixed_dictionaries({"messages": _messages}),
    st.fixed_dictionaries({"prompt": st.one_of(_texts, st.lists(st.one_of(_texts, st.integers()), max_size=3),
                                               st.integers(), st.none())}),
    st.fixed_dictionaries({"messages": st.one_of(st.just("nope"), st.none()), "prompt": _texts}),
    st.just({}), st.just({"input": "x"}))


@settings(max_examples=400, deadline=None)
@given(_bodies, st.integers(-1, 7), st.sampled_from([0, 1, 2, 5, 100, 4096, 100_000]))
def test_prompt_of_gives_what_the_three_readings_gave(doc, messages, max_bytes):
    """One pass: the canonical bytes (prompt_bytes), the prefix key's bytes (prefix_hash hashes
    them) and the characters (the handler's count before), on random chat and completion bodies:
    parts, non-dict messages, roles that are not strings, non-ASCII text, lone surrogates."""
    data, lead, chars = prompt_of(doc, messages, max_bytes)
    assert data == prompt_bytes(doc)
    assert (key_hash(lead) if lead is not None else None) == prefix_hash(doc, messages, max_bytes)
    assert chars == _prompt_chars(doc)


@settings(max_examples=600, deadline=None)
@given(_bodies, st.integers(-1, 7), st.sampled_from([-1, 0, 1, 2, 5, 100, 4096, 100_000]),
       st.sampled_from([1, 3, 16, 64, 512]), st.sampled_from([0, 1, 2, 5, MAX_BLOCKS]))
def test_compiled_prompt_keys_agree_with_the_reference(doc, messages, max_bytes, block, max_blocks):
    """The compiled prompt reading (_wire.prompt_keys: the strings' UTF-8 in place, hashed without the
    canonical bytes built in Python) gives what prompt_of and block_hashes give, or declines (None) and
    the reference reads the body: on random chat and completion bodies with parts, non-dict
    messages, roles that are not strings, non-ASCII text and lone surrogates."""
    expected = prompt_keys_py(doc, messages, max_bytes, block, max_blocks)
    compiled = _wire.prompt_keys(doc, messages, max_bytes, block, max_blocks)
    if compiled is not None:
        assert compiled == expected
    assert prompt_keys(doc, messages, max_bytes, block, max_blocks) == expected
    data, lead, chars = prompt_of(doc, messages, max_bytes)
    assert expected == (block_hashes_py(data, block, max_blocks), lead, chars)


def test_the_compiled_prompt_keys_read_a_chat_body_and_decline_the_rest():
    """A chat body parsed from JSON is read in C (the picker's hot path); a lone surrogate, a subclass
    of a JSON type, a completion's prompt and a negative prefix bound are left to the reference."""
    doc = json.loads(json.dumps({"messages": [{"role": "system", "content": "é" * 700},
                                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}))
    keys, lead, chars = _wire.prompt_keys(doc, 1, 100, BLOCK_BYTES, MAX_BLOCKS)
    data, lead_py, chars_py = prompt_of(doc, 1, 100)
    assert (keys, lead, chars) == (block_hashes_py(data), lead_py, chars_py) and len(keys) == 2 and len(lead) == 100

    class Text(str):
        pass

    for declined in ({"messages": [{"role": "user", "content": "\ud800"}]}, {"messages": [{"content": Text("x")}]},
                     {"prompt": "abc"}, {}):
        assert _wire.prompt_keys(declined, 1, 100, BLOCK_BYTES, MAX_BLOCKS) is None
    assert _wire.prompt_keys(doc, 1, -1, BLOCK_BYTES, MAX_BLOCKS) is None
    with pytest.raises(ValueError):
        _wire.prompt_keys(doc, 1, 100, 0, MAX_BLOCKS)


def test_capacity_in_blocks_follows_the_kv_cache():
    assert capacity_blocks(500_000, 4.0) == 500_000 * 4 // BLOCK_BYTES
    assert capacity_blocks(500_000, 2.0) == capacity_blocks(250_000, 4.0)
    assert capacity_blocks(0, 4.0) == 0 and capacity_blocks(10, 4.0) == 1


# --- the index: bound, eviction, longest match ----------------------------------------------------


def keys(text: bytes) -> tuple[int, ...]:
    return block_hashes(text, block_bytes=4, max_blocks=1000)


def _old_insert(held: dict, index_keys: OrderedDict, blocks: tuple, capacity: int) -> None:
    """PrefixIndex.insert's LRU update before its fast path (frozen copy): its reference."""
    keys = held.get("k")
    if keys is None:
        if capacity <= 0 or not blocks:
            return
        keys = held["k"] = index_keys
    for key in reversed(blocks):
        if key in keys:
            keys.move_to_end(key)
        else:
            keys[key] = None
    while len(keys) > capacity:
        keys.popitem(last=False)
    if not keys:
        del held["k"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), max_size=8).map(tuple), st.integers(0, 12)), max_size=40))
def test_insert_orders_keys_as_the_loop_did(inserts):
    """The fast path (a prompt whose last key is held: every key moved in C) leaves the same keys in
    the same LRU order as the key-by-key loop, also for key tuples that are not prefix-closed (what a
    collision would give: the loop takes over at the first key missing) and with evictions."""
    index = PrefixIndex()
    old: dict = {}
    for blocks, capacity in inserts:
        index.insert("e", blocks, capacity)
        _old_insert(old, old.get("k", OrderedDict()), blocks, capacity)
        assert index.keys("e") == tuple(old.get("k", ()))


def test_longest_match_per_endpoint():
    index = PrefixIndex()
    index.insert("a", keys(b"aaaabbbbcccc"), 100)
    index.insert("b", keys(b"aaaabbbbdddd"), 100)
    index.insert("c", keys(b"zzzzbbbbcccc"), 100)
    assert index.matched(keys(b"aaaabbbbccccdddd"), ["a", "b", "c", "d"]) == {"a": 3, "b": 2}
    assert index.matched(keys(b"aaaa"), ["a", "b", "c"]) == {"a": 1, "b": 1}
    assert index.matched(keys(b"qqqq"), ["a", "b", "c"]) == {}
    assert index.matched((), ["a"]) == {}
    assert index.matched(keys(b"aaaabbbbcccc"), ["b"]) == {"b": 2}  # only the endpoints asked about


def test_the_bound_holds_and_the_least_recently_sent_goes_first():
    index = PrefixIndex()
    one, two, three = keys(b"1111aaaa"), keys(b"2222bbbb"), keys(b"3333cccc")
    index.insert("e", one, 4)
    index.insert("e", two, 4)
    assert index.held("e") == 4
    index.insert("e", one, 4)  # refreshed: now two is the least recently sent
    index.insert("e", three, 4)
    assert index.held("e") == 4
    assert index.matched(one, ["e"]) == {"e": 2} and index.matched(three, ["e"]) == {"e": 2}
    assert index.matched(two, ["e"]) == {}


def test_a_prompt_is_evicted_tail_first_so_its_prefix_outlives_it():
    index = PrefixIndex()
    long = keys(b"pppp" * 6)
    index.insert("e", long, 6)
    index.insert("e", keys(b"xxxxyyyy"), 6)  # two more blocks: two of long's must go
    assert index.matched(long, ["e"]) == {"e": 4}
    assert index.keys("e")[:2] == long[2:4][::-1]  # the next to go: long's tail, its last block first


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.sampled_from([b"aaaa", b"bbbb", b"cccc"]),
                                                           min_size=1, max_size=6)), min_size=1, max_size=40),
       st.integers(1, 12))
def test_bounded_prefix_closed_and_matches_a_plain_scan(inserts, capacity):
    """Whatever is inserted: each endpoint holds at most ``capacity`` keys, its keys are prefix-closed,
    and the binary-search match equals a walk over the blocks."""
    index = PrefixIndex()
    sent = []
    for endpoint, parts in inserts:
        ks = keys(b"".join(parts))
        sent.append(ks)
        index.insert(endpoint, ks, capacity)
        assert index.held(endpoint) <= capacity
    for e in "ab":
        held = set(index.keys(e))
        for ks in sent:
            for i, k in enumerate(ks):
                if k in held:
                    assert set(ks[:i]) <= held
            walked = 0
            while walked < len(ks) and ks[walked] in held:
                walked += 1
            assert index.matched(ks, [e]).get(e, 0) == walked


def test_no_capacity_keeps_nothing_and_retain_forgets_departed_endpoints():
    index = PrefixIndex()
    index.insert("a", keys(b"aaaa"), 0)
    assert index.held("a") == 0 and len(index) == 0
    index.insert("a", keys(b"aaaa"), 5)
    index.insert("b", keys(b"bbbb"), 5)
    index.retain(["b"])
    assert index.held("a") == 0 and index.held("b") == 1 and len(index) == 1


def test_last_sent_counts_prompts_recorded():
    index = PrefixIndex()
    assert index.last_sent("a") == 0
    index.insert("a", keys(b"aaaa"), 5)
    index.insert("b", keys(b"bbbb"), 5)
    index.insert("a", keys(b"cccc"), 5)
    assert (index.last_sent("a"), index.last_sent("b")) == (3, 2)


# --- determinism across processes, cost ---------------------------------------------------------

_CHILD = """
import json, sys
from ext_proc.prefix_index import PrefixIndex, block_hashes, prompt_bytes
docs = json.loads(sys.stdin.read())
index = PrefixIndex()
out = []
for i, doc in enumerate(docs):
    ks = block_hashes(prompt_bytes(doc))
    out.append([list(ks), index.matched(ks, ["a", "b", "c"])])
    index.insert("abc"[i % 3], ks, 40)
print(json.dumps([out, {e: list(index.keys(e)) for e in "abc"}]))
"""


def test_the_same_prompts_give_the_same_keys_and_index_in_another_process():
    system = "You are a careful assistant. " * 80
    docs = [chat(("system", system), ("user", f"question {i} " * (40 + i))) for i in range(12)]
    docs.append({"prompt": "é☃\ud800 lone surrogate " * 60})
    runs = []
    for seed in ("0", "12345"):  # Python's own hash() differs between these: the keys must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(docs), capture_output=True, text=True,
                              cwd=ROOT, env=env, check=True)
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]
    assert runs[0][0][0][0] == list(block_hashes(prompt_bytes(docs[0])))  # and equal to this process's
    assert any(m for _, m in runs[0][0][1:])  # the shared system prompt matched somewhere


def test_a_6000_token_prompt_is_matched_on_its_holder_among_16():
    """Keys of a 6 000-token chat prompt (24 000 characters) and one lookup over 16 endpoints (what
    that costs: ``python3 -m bench.prefix_cost``)."""
    doc = chat(("system", "s" * 24_000), ("user", "q" * 4_800))
    data = prompt_bytes(doc)
    index = PrefixIndex()
    ks = block_hashes(data)
    for i in range(16):
        index.insert(f"10.0.0.{i}:8000", ks if i == 3 else block_hashes(bytes([i]) * len(data)), 4000)
    endpoints = [f"10.0.0.{i}:8000" for i in range(16)]
    assert index.matched(ks, endpoints) == {"10.0.0.3:8000": len(ks)}
    assert block_hashes(prompt_bytes(doc)) == ks
    index.insert("10.0.0.3:8000", ks, 4000)
    assert index.matched(ks, endpoints) == {"10.0.0.3:8000": len(ks)}


def test_conversations_are_remembered_least_recently_sent_first_out(monkeypatch):
    import ext_proc.prefix_index as prefix_index

    monkeypatch.setattr(prefix_index, "MAX_CONVERSATIONS", 3)
    index = PrefixIndex()
    for c, e in ((1, "a:1"), (2, "b:1"), (3, "a:1")):
        index.sent_turn(c, e)
    index.sent_turn(1, "b:1")  # conversation 1's latest turn went elsewhere: now the most recent
    index.sent_turn(4, "c:1")  # over the bound: 2, the least recently sent, is forgotten
    assert [index.turn_endpoint(c) for c in (1, 2, 3, 4)] == ["b:1", None, "a:1", "c:1"]


def test_an_endpoint_that_leaves_takes_its_conversations_with_it():
    index = PrefixIndex()
    index.insert("a:1", block_hashes(b"x" * 2048), 100)
    index.sent_turn(1, "a:1")
    index.sent_turn(2, "b:1")
    index.retain(["b:1"])
    assert index.turn_endpoint(1) is None and index.turn_endpoint(2) == "b:1" and index.held("a:1") == 0
