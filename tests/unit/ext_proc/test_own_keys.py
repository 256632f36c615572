"""``picker.kv_events.keys: vllm``: vLLM's blocks re-keyed by the picker's own chain of their token ids
(ext_proc/own_keys.py, ext_proc/kv_events.py), and a request keyed the same way from the model's chat
template and tokenizer (ext_proc/engine_keys.py)."""

from __future__ import annotations

import os
import random

import msgpack
import pytest

from ext_proc.engine_keys import chain_keys, load_vllm_keys, vllm_keys
from ext_proc.kv_events import KvEventsUnavailable, apply, check_feed, decode_batch
from ext_proc.own_keys import OwnKeys
from ext_proc.prefix_events import EventIndex
from tests.support.chat_tokenizer import write_chat_tokenizer

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BS = 16


def sha() -> bytes:
    """A block hash as vLLM's sha256 ones look from outside: 32 bytes no one can compute."""
    return os.urandom(32)


def stored(hashes, parent, tokens, **extra) -> dict:
    """A map-encoded BlockStored (vLLM after its PR 42892)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
            "group_idx": 0, "kv_cache_spec_kind": "full_attention", **extra}


def feed(index: EventIndex, own: OwnKeys, endpoint: str, *events, capacity: int = 10_000) -> None:
    apply(index, endpoint, decode_batch(msgpack.packb([1.0, list(events), 0])), capacity, own)


def test_opaque_hashes_are_matched_by_the_token_ids_they_carry():
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(BS * 6 + 5)]
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    first, rest = [sha() for _ in range(4)], [sha() for _ in range(2)]
    feed(index, own, A, stored(first, None, tokens[:BS * 4]))
    request = chain_keys(tokens, BS)
    assert index.matched(request, [A, B]) == {A: 4}
    # A later request's new blocks: their parent is the last block it found cached (a prefix hit).
    feed(index, own, A, stored(rest, first[-1], tokens[BS * 4:BS * 6]))
    assert index.matched(request, [A]) == {A: 6} and own.known(A) == 6
    # Removed by hash alone: the own keys go; evicted tail first, as vLLM frees a request's blocks.
    feed(index, own, A, {"type": "BlockRemoved", "block_hashes": rest[::-1], "medium": "GPU"})
    assert index.matched(request, [A]) == {A: 4} and own.known(A) == 4
    feed(index, own, A, {"type": "AllBlocksCleared"})
    assert index.matched(request, [A]) == {} and own.known(A) == 0 and index.held(A) == 0


def test_the_same_tokens_under_each_engines_own_hashes_match_on_both():
    tokens = list(range(BS * 3))
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    feed(index, own, A, stored([sha() for _ in range(3)], None, tokens))
    feed(index, own, B, ["BlockStored", [rng_int() for _ in range(2)], None, tokens[:BS * 2], BS, None, "GPU"])
    assert index.matched(chain_keys(tokens, BS), [A, B]) == {A: 3, B: 2}


def rng_int() -> int:
    return int.from_bytes(os.urandom(8), "big")  # vLLM's builtin hashes: unsigned 64-bit ints


def test_a_block_whose_parent_is_unknown_is_dropped_and_so_are_its_children():
    tokens = list(range(BS * 4))
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    lost, child, grandchild = sha(), [sha()], [sha()]
    feed(index, own, A, stored(child, lost, tokens[BS:BS * 2]))  # its parent's BlockStored never came
    feed(index, own, A, stored(grandchild, child[0], tokens[BS * 2:BS * 3]))
    assert index.held(A) == 0 and own.known(A) == 0
    feed(index, own, A, {"type": "BlockRemoved", "block_hashes": child, "medium": "GPU"})  # unknown: ignored
    assert index.held(A) == 0


def test_a_parent_cached_before_the_picker_subscribed_is_found_in_a_prompt_it_just_sent_there():
    """A hot prefix the engine cached before the picker started (never published to it) becomes known at
    the first request the picker sends there that extends it; its ancestors go with it."""
    rng = random.Random(3)
    system = [rng.randrange(50_000) for _ in range(BS * 3)]  # the engine holds these 3 blocks, unseen
    prompt = system + [rng.randrange(50_000) for _ in range(BS * 3)]
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    unseen = sha()
    other = [rng.randrange(50_000) for _ in range(BS * 5)]
    index.insert(A, chain_keys(other, BS), 10_000)  # another prompt sent there: not this chain
    index.insert(A, chain_keys(prompt, BS), 10_000)  # the picker's pick
    new = [sha() for _ in range(3)]
    feed(index, own, A, stored(new, unseen, prompt[BS * 3:]))  # vLLM: the 3 new blocks after a prefix hit
    assert index.matched(chain_keys(prompt, BS), [A]) == {A: 6} and own.known(A) == 4
    # a second prompt sharing the system prompt, from another gateway: its parent is known now
    second = system + [rng.randrange(50_000) for _ in range(BS * 2)]
    feed(index, own, A, stored([sha(), sha()], unseen, second[BS * 3:]))
    assert index.matched(chain_keys(second, BS), [A]) == {A: 5}
    # evicted (children first, as vLLM frees them): the ancestors held through the parent go with it
    feed(index, own, A, {"type": "BlockRemoved", "block_hashes": new[::-1], "medium": "GPU"})
    assert index.matched(chain_keys(prompt, BS), [A]) == {A: 3}
    feed(index, own, A, {"type": "BlockRemoved", "block_hashes": [unseen], "medium": "GPU"})
    assert index.matched(chain_keys(second, BS), [A]) == {}


def test_an_unknown_parent_no_recent_prompt_explains_is_dropped():
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    index.insert(A, chain_keys(list(range(BS * 4)), BS), 10_000)
    feed(index, own, A, stored([sha()], sha(), list(range(1000, 1000 + BS))))  # tokens no recent prompt has
    feed(index, own, B, stored([sha()], sha(), list(range(BS, BS * 2))))  # B was sent nothing
    assert index.held(A) == index.held(B) == 0 and own.known(A) == own.known(B) == 0


@pytest.mark.parametrize("extra", [{"extra_keys": [["image-hash"]]}, {"lora_name": "adapter"}, {"lora_id": 3},
                                   {"extra_keys": [("salt",)]}])
def test_blocks_whose_hash_covers_more_than_tokens_are_not_indexed(extra):
    tokens = list(range(BS * 2))
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    first = [sha()]
    feed(index, own, A, stored(first, None, tokens[:BS], **extra))
    feed(index, own, A, stored([sha()], first[0], tokens[BS:]))
    assert index.held(A) == 0 and own.known(A) == 0


def test_other_groups_media_and_token_counts_that_do_not_fit_are_left_out():
    tokens = list(range(BS * 2))
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    feed(index, own, A, stored([sha(), sha()], None, tokens, group_idx=1),  # a sliding-window group
         stored([sha(), sha()], None, tokens, medium="CPU"),
         stored([sha(), sha()], None, tokens[:BS + 3]))  # not block_size a block (vLLM issue 44451)
    assert index.held(A) == 0 and own.known(A) == 0


def test_the_map_is_bounded_with_the_index_and_forgets_endpoints_that_left():
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    hashes = [sha() for _ in range(10)]
    feed(index, own, A, stored(hashes, None, list(range(BS * 10))), capacity=4)
    assert own.known(A) == 4 and index.held(A) == 4
    feed(index, own, B, stored([sha()], None, list(range(BS))))
    own.retain([B])
    assert own.known(A) == 0 and own.known(B) == 1


def test_a_map_encoded_batch_decodes_as_a_positional_one():
    h = sha()
    positional = decode_batch(msgpack.packb([1.0, [["BlockStored", [h], None, list(range(BS)), BS, None, "GPU"],
                                                   ["BlockRemoved", [h], "GPU"], ["AllBlocksCleared"]]]))
    mapped = decode_batch(msgpack.packb({"ts": 1.0, "events": [
        stored([h], None, list(range(BS))), {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU",
                                             "group_idx": 0}, {"type": "AllBlocksCleared"}]}))
    assert positional == mapped and len(mapped) == 3


# --- a request keyed as vLLM's OpenAI server tokenizes it -----------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return str(write_chat_tokenizer(tmp_path_factory.mktemp("chatml")))


def encoded(tokenizer: str, text: str, special: bool = False) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tokenizer}/tokenizer.json").encode(text, add_special_tokens=special).ids


def test_a_chat_is_rendered_with_the_models_template_and_tokenized_without_special_tokens(tokenizer):
    keys = load_vllm_keys(tokenizer)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    doc = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]}
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"
    assert keys(doc) == encoded(tokenizer, want)
    assert keys({**doc, "add_generation_prompt": False}) == encoded(tokenizer, want.removesuffix(
        "<|im_start|>assistant\n"))
    assert keys({**doc, "add_special_tokens": True}) == encoded(tokenizer, want, special=True)


def test_a_completion_gets_special_tokens_by_default_and_token_ids_as_they_are(tokenizer):
    keys = load_vllm_keys(tokenizer)
    assert keys({"prompt": "hello"}) == encoded(tokenizer, "hello", special=True) != encoded(tokenizer, "hello")
    assert keys({"prompt": "hello", "add_special_tokens": False}) == encoded(tokenizer, "hello")
    assert keys({"prompt": [5, 6, 7]}) == [5, 6, 7]


@pytest.mark.parametrize("doc", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-1"},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"},
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True, "continue_final_message": True},
    {"messages": "hi"}, {"prompt": ["a", "b"]}, {"prompt": 5},
])
def test_a_body_it_cannot_key_as_vllm_gets_no_keys(tokenizer, doc):
    assert vllm_keys(doc, BS, tokenizer) == ()


def test_the_request_and_the_events_meet_on_the_same_keys(tokenizer):
    doc = {"messages": [{"role": "user", "content": "the same long question, " * 8}]}
    ids = load_vllm_keys(tokenizer)(doc)
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    full = len(ids) // BS
    feed(index, own, A, stored([sha() for _ in range(full)], None, ids[:full * BS]))
    assert full > 3 and index.matched(vllm_keys(doc, BS, tokenizer), [A]) == {A: full}


def test_check_feed_refuses_a_directory_without_a_tokenizer_naming_the_setting(tmp_path):
    with pytest.raises(KvEventsUnavailable, match=r"picker\.kv_events\.tokenizer: .*not a Hugging Face tokenizer"):
        check_feed(str(tmp_path), "vllm")


def test_a_parent_searched_in_vain_is_searched_again_only_after_another_pick():
    index, own = EventIndex(pending_s=0.0), OwnKeys()
    system = list(range(BS * 2))
    parent = sha()
    index.insert(A, chain_keys(list(range(5000, 5000 + BS * 3)), BS), 10_000)
    later = stored([sha()], parent, system[BS:])
    feed(index, own, A, later)  # no recent prompt has it: remembered as searched
    index.insert(A, chain_keys(system, BS), 10_000)  # now one has: searched again
    feed(index, own, A, stored([sha()], parent, system[BS:]))
    assert index.matched(chain_keys(system, BS), [A]) == {A: 2}
    missed = OwnKeys()
    assert missed.resolve(A, parent, system[BS:], BS, [chain_keys([7] * BS * 3, BS)], 1, 100) is None
    assert missed.resolve(A, parent, system[BS:], BS, [chain_keys(system, BS)], 1, 100) is None  # not again
    assert missed.resolve(A, parent, system[BS:], BS, [chain_keys(system, BS)], 2, 100) == chain_keys(system, BS)[:1]
