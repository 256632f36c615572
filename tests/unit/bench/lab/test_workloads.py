"""The lab's workloads: seeded, shaped as their sources describe, traces read strictly."""

from __future__ import annotations

import random

import pytest

from bench.lab.policy import Prompt
from bench.lab.workloads.base import Sizing
from bench.lab.workloads.mooncake import BLOCK_TOKENS, MooncakeTrace
from bench.lab.workloads.sessions import ChatSessions
from bench.lab.workloads.shared_prefix import SharedPrefix
from bench.lab.workloads.sharegpt_chat import ShareGptChat, conversations
from bench.lab.workloads.tokens import CHARS_PER_TOKEN, Synth, Tokenizer, prompt_keys
from bench.lab.workloads.trace import JsonlTrace, TraceError
from bench.lab.workloads.uniform import Uniform
from sim.engines.kv import chain_hashes

SIZING = Sizing(kv_tokens=1_200_000, engines=4)


def _all(workload, qps=5.0, duration=60.0, seed=1):
    return list(workload.arrivals(qps, duration, SIZING, random.Random(seed)))


def test_shared_prefix_fills_its_share_of_the_kv_cache_and_reuses_each_prompt() -> None:
    w = SharedPrefix()
    groups = w.group_count(SIZING)
    assert groups == round(0.73 * 1_200_000 / (6000 + 5 * 1200))
    arrivals = _all(w)
    assert 250 < len(arrivals) < 350  # Poisson at 5 per s for 60 s
    prompts = {id(d.prompt) for _, d in arrivals}
    assert len(prompts) < len(arrivals)  # the same (group, user) prompt object is sent again
    d = arrivals[0][1]
    assert [len(m.tokens) for m in d.prompt.messages] == [6000, 1200] and d.output_tokens == 1000
    system_of = {id(d.prompt.messages[0]) for _, d in arrivals}
    assert len(system_of) <= groups
    assert len(d.prompt.messages[0].text) == 6000 * CHARS_PER_TOKEN
    assert [t for t, _ in _all(w)] == [t for t, _ in arrivals]  # the same seed, the same arrivals


def test_synthetic_text_tells_tokens_apart_as_the_ids_do() -> None:
    a, b = Synth(1).message("user", 50), Synth(1).message("user", 50)
    assert a.tokens == b.tokens and a.text == b.text
    c = Synth(2).message("user", 50)
    assert c.text != a.text


def test_sharegpt_turns_resend_the_history_with_the_real_replies() -> None:
    convs = conversations()
    assert len(convs) > 10_000
    assert all(c[0][0] == "user" and len(c) % 2 == 0 for c in convs[:200])
    w = ShareGptChat()
    first = _all(w, qps=2.0)[0][1]
    assert first.next is not None
    second = first.next.draft()
    assert second is not None
    n = first.prompt.tokens
    assert second.prompt.token_ids[:n] == first.prompt.token_ids  # the history is resent as it was
    assert second.prompt.messages[len(first.prompt.messages)].role == "assistant"
    assert second.prompt.messages[len(first.prompt.messages)].tokens.__len__() == first.output_tokens
    # the engine generates the real reply, so its cached blocks are the ones the next turn resends
    assert first.output_ids == second.prompt.messages[len(first.prompt.messages)].tokens
    assert first.prompt.messages[0].role == "system"


def test_sharegpt_sessions_replaying_one_conversation_share_no_prefix() -> None:
    """Once every conversation is taken, sessions start over; each opens with its own system line."""
    w = ShareGptChat(min_turns=40)
    by_conversation: dict[str, list] = {}
    for _, d in _all(w, qps=400.0):
        by_conversation.setdefault(d.prompt.messages[1].text, []).append(d)
    a, b = next(ds for ds in by_conversation.values() if len(ds) > 1)[:2]
    assert [m.tokens for m in a.prompt.messages[1:]] == [m.tokens for m in b.prompt.messages[1:]]  # one chat ...
    assert a.prompt.token_ids[:16] != b.prompt.token_ids[:16]  # ... as two users' chats


def test_tokenizer_tokenizes_each_text_once() -> None:
    tok = Tokenizer()
    a = tok("hello world")
    assert tok("hello world") is a


def test_uniform_prompts_share_no_prefix() -> None:
    arrivals = _all(Uniform(), qps=10.0)
    firsts = {d.prompt.token_ids[:16] for _, d in arrivals}
    assert len(firsts) == len(arrivals)
    assert all(512 <= d.prompt.tokens <= 2048 and 128 <= d.output_tokens <= 512 for _, d in arrivals)


def test_sessions_carry_headers_versions_memory_and_bursts() -> None:
    w = ChatSessions(anon_share=0.2, versions=(("v1", 0.5), ("v2", 0.5)), memory_mib=((8192.0, 1.0),),
                     burst=(4.0, 1.0, 3.0))
    arrivals = _all(w, qps=20.0)
    heads = [dict(d.headers) for _, d in arrivals]
    assert {h.get("model-version") for h in heads} == {b"v1", b"v2"}
    assert all(h["x-sim-memory-mib"] == b"8192" and d.memory_mib == 8192.0
               for h, (_, d) in zip(heads, arrivals, strict=True))
    sessions = [d for _, d in arrivals if d.session is not None]
    assert sessions and all(dict(d.headers)["x-session-id"] for d in sessions)
    in_burst = sum(1 for t, _ in arrivals if t % 4.0 < 1.0)
    assert in_burst > len(arrivals) * 0.4  # 3x the rate for a quarter of each period: half the arrivals
    nxt = sessions[0].next
    assert nxt is not None
    follow = nxt.draft()
    assert follow.prompt.token_ids[:sessions[0].prompt.tokens] == sessions[0].prompt.token_ids


def test_sessions_open_with_a_context_of_their_own_resent_every_turn() -> None:
    w = ChatSessions(turns=(3, 3), system_tokens=40, opening_tokens=200, user_tokens=20, output_tokens=8)
    firsts = [d for _, d in _all(w, qps=6.0)]
    assert [len(m.tokens) for m in firsts[0].prompt.messages] == [40, 200]
    assert len({d.prompt.messages[1].tokens for d in firsts}) == len(firsts)  # no two sessions share it
    assert firsts[0].next is not None
    second = firsts[0].next.draft()
    assert [len(m.tokens) for m in second.prompt.messages] == [40, 200, 8, 20]
    assert second.prompt.messages[1] is firsts[0].prompt.messages[1]


def test_a_jsonl_trace_replays_scaled_to_the_qps(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "messages": [{"role": "user", "content": "hi there"}], "output_tokens": 4}\n'
                    '{"t": 1, "prompt": "once upon a time", "output_tokens": 8, "headers": {"X-Session-Id": "a"}}\n'
                    '\n'
                    '{"t": 2, "prompt_token_ids": [1, 2, 3, 4], "output_tokens": 2, "memory_mib": 512}\n')
    trace = JsonlTrace(path)
    own = [t for t, _ in trace.arrivals(0, 100.0, SIZING, random.Random(1))]
    assert own == [0.0, 1.0, 2.0]
    fast = [t for t, _ in trace.arrivals(2.0, 100.0, SIZING, random.Random(1))]
    assert fast == [0.0, 0.5, 1.0]  # its own rate is 1 per s
    rows = trace.rows()
    assert rows[1][1].headers == (("x-session-id", b"a"),)
    assert rows[2][1].prompt.token_ids == (1, 2, 3, 4) and rows[2][1].memory_mib == 512.0
    assert rows[0][1].prompt.chat and not rows[1][1].prompt.chat


@pytest.mark.parametrize(("line", "named"), [
    ('{"messages": [{"role": "user", "content": "x"}], "output_tokens": 1}', "'t'"),
    ('{"t": 0, "prompt": "x"}', "'output_tokens'"),
    ('{"t": 0, "prompt": "x", "messages": [], "output_tokens": 1}', "exactly one of"),
    ('{"t": 0, "prompt_token_ids": ["a"], "output_tokens": 1}', "'prompt_token_ids'"),
    ('{"t": 0, "prompt": "x", "output_tokens": 1, "headers": {"a": 1}}', "'headers'"),
    ('not json', "not JSON"),
])
def test_a_bad_trace_line_is_refused_naming_the_line_and_the_field(tmp_path, line: str, named: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceError) as err:
        JsonlTrace(path).rows()
    assert f"{path}:2" in str(err.value) and named in str(err.value)


def test_mooncake_hash_ids_share_exactly_their_blocks(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]}\n'
                    '{"timestamp": 500, "input_length": 600, "output_length": 5, "hash_ids": [7, 3]}\n')
    rows = MooncakeTrace(path).rows()
    (t0, a), (t1, b) = rows
    assert (t0, t1) == (0.0, 0.5)
    assert a.prompt.tokens == 1100 and b.prompt.tokens == 600
    assert a.prompt.token_ids[:BLOCK_TOKENS] == b.prompt.token_ids[:BLOCK_TOKENS]
    assert a.prompt.token_ids[BLOCK_TOKENS:BLOCK_TOKENS + 88] != b.prompt.token_ids[BLOCK_TOKENS:]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="cannot hold input_length 2000"):
        MooncakeTrace(bad).rows()


def test_prompt_keys_reuse_a_shared_start_and_stay_the_engines_keys() -> None:
    """A chat's turns resend its history and a group's prompts share a system message: the keys hash only
    what is new, and are still exactly the chain of the whole prompt's tokens, at any block size."""
    synth = Synth(11)
    system = synth.message("system", 100)
    history: tuple = ()
    for turn in range(12):
        question = synth.message("user", 1 + 7 * turn % 45)
        prompt = Prompt((system, *history, question))
        other = Prompt((system, synth.message("user", 33)))
        for bs in (16, 7):
            assert prompt_keys(prompt, bs) == tuple(chain_hashes(prompt.token_ids, bs))
            assert prompt_keys(other, bs) == tuple(chain_hashes(other.token_ids, bs))
        history = (*history, question, synth.message("assistant", 13))
