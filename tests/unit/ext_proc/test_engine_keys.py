"""A prompt keyed as the ``llm`` simulator keys it (ext_proc/engine_keys.py): the picker's rule, in
Python and compiled, against the simulator's own rendering, tokenizer and block hash chain."""

from __future__ import annotations

import json
import random
import zlib

import pytest
from ext_proc._wire import engine_keys as compiled

from ext_proc import engine_keys as ek
from sim.engines.kv import chain_hashes
from sim.protocol import RequestError, render_prompt
from sim.tokenizer import load, write_small_tokenizer
from sim.tokens import tokenize

TEXT = "ab é😀c\n{}\"\\\ud800x"


def _random_body(rnd: random.Random) -> dict:
    def text(n: int) -> str:
        return "".join(rnd.choice(TEXT) for _ in range(rnd.randrange(n)))

    if rnd.random() < 0.3:
        return {"prompt": text(400) if rnd.random() < 0.7 else [text(50), text(50)]}
    messages = []
    for _ in range(rnd.randrange(6)):
        content: object = text(300)
        if rnd.random() < 0.2:
            content = [{"type": "text", "text": text(80)} for _ in range(rnd.randrange(1, 3))]
        elif rnd.random() < 0.1:
            content = [{"type": "image_url", "image_url": {"url": text(20)}}]
        elif rnd.random() < 0.05:
            content = None
        msg = {"role": rnd.choice(["system", "user", "assistant", 7]), "content": content}
        if rnd.random() < 0.1:
            del msg["role"]
        messages.append(msg)
    return {"messages": messages}


def _simulators(doc: dict, block_size: int) -> tuple[int, ...]:
    try:
        text = render_prompt("chat" if "messages" in doc else "completion", doc)
    except RequestError:
        return ()
    return tuple(chain_hashes(tokenize(text), block_size))


def test_the_pickers_keys_are_the_simulators_on_random_bodies():
    rnd = random.Random(37)
    seen = 0
    for _ in range(800):
        doc = json.loads(json.dumps(_random_body(rnd)))  # as the picker reads it: parsed JSON
        size = rnd.choice([1, 2, 3, 16, 16, 16, 64])
        want = _simulators(doc, size)
        seen += len(want)
        assert ek.engine_keys_py(doc, size) == want
        assert ek.engine_keys(doc, size) == want
    assert seen > 10_000


@pytest.mark.parametrize("doc", [{"messages": "hi"}, {"messages": ["hi"]}, {"prompt": 5}])
def test_a_body_the_simulator_refuses_has_no_keys(doc):
    with pytest.raises(RequestError):
        render_prompt("chat" if "messages" in doc else "completion", doc)
    assert ek.engine_keys(doc, 16) == ek.engine_keys_py(doc, 16) == ()


def test_cpythons_hash_restated_in_c_at_the_edges():
    """Token ids near the vocabulary's end and keys of both signs (the parent's hash is taken as
    CPython takes an int's: modulo 2**61 - 1, with its sign)."""
    for raw in (b"", b"abc", b"\xff" * 4 * 16, bytes(range(256)) * 9):
        for size in (1, 5, 16):
            tokens = ek.tokens_of(raw)
            want = ek.chain_keys(tokens, size)
            assert compiled(raw, 4, 32000, size) == want
            assert compiled(raw, 3, 7, size) == ek.chain_keys(
                [zlib.crc32(raw[i:i + 3]) % 7 for i in range(0, len(raw), 3)], size)
    keys = ek.chain_keys(ek.tokens_of(bytes(range(256)) * 40), 1)
    assert any(k < 0 for k in keys) and any(k > 0 for k in keys)
    with pytest.raises(ValueError):
        compiled(b"abcd", 4, 32000, 0)
    with pytest.raises(ValueError):
        ek.chain_keys([1], 0)


def test_a_20_kib_chat_prompts_keys_compiled_are_pythons():
    """What each costs: ``python3 -m bench.prefix_cost`` (``engine_keys/...``)."""
    doc = {"messages": [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "q" * 18_000}]}
    keys = ek.engine_keys(doc, 16)
    assert len(keys) > 300 and keys == ek.engine_keys_py(doc, 16)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> str:
    return str(write_small_tokenizer(tmp_path_factory.mktemp("tok")))


def test_with_a_tokenizer_the_keys_are_those_of_a_simulator_counting_with_it(small_tokenizer):
    encode = load(small_tokenizer)
    rnd = random.Random(38)
    for _ in range(100):
        doc = json.loads(json.dumps(_random_body(rnd)))
        try:
            text = render_prompt("chat" if "messages" in doc else "completion", doc)
        except RequestError:
            assert ek.engine_keys(doc, 4, small_tokenizer) == ()
            continue
        want = tuple(chain_hashes(encode(text), 4))
        assert ek.engine_keys(doc, 4, small_tokenizer) == want
    doc = {"messages": [{"role": "user", "content": "the model server answers " * 40}]}
    assert ek.engine_keys(doc, 4, small_tokenizer) != ek.engine_keys(doc, 4)  # not the 4-byte rule


def test_a_directory_without_a_tokenizer_is_a_value_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        ek.load_encoder(str(tmp_path))
