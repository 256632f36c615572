"""The tokenizer rule, session history tokens, the backend configuration."""

import pytest

from sim.config import BackendConfig
from sim.engines.kv import chain_hashes
from sim.tokens import estimate_tokens, session_tokens, tokenize


def test_tokenizer_rule_is_four_bytes_per_token_and_prefix_preserving():
    assert tokenize("") == [] and estimate_tokens("") == 1
    ids = tokenize("abcdefghij")
    assert len(ids) == 3 == estimate_tokens("abcdefghij")  # "abcd" "efgh" "ij"
    assert ids == tokenize("abcdefghij") and all(0 <= i < 32000 for i in ids)
    assert tokenize("abcdefgh") == ids[:2]
    assert len(tokenize("é" * 4)) == 2  # UTF-8 bytes, not characters
    long, longer = "x" * 1001, "x" * 1001 + "y" * 50
    assert tokenize(longer)[: len(tokenize(long)) - 1] == tokenize(long)[:-1]


def test_block_keys_chain_every_token_up_to_the_block():
    a = tokenize("a" * 64 + "b" * 64)
    b = tokenize("a" * 64 + "c" * 64)
    ka, kb = chain_hashes(a, 16), chain_hashes(b, 16)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    c = tokenize("b" * 64 + "a" * 64)
    assert chain_hashes(c, 16)[1] != ka[0]  # same tokens, other position: another key
    assert chain_hashes(a[:20], 16) == ka[:1]  # a partial block has no key


def test_text_that_is_not_valid_unicode_still_tokenizes():
    assert len(tokenize("a\ud800b")) == 2 and estimate_tokens("\udcff" * 4) == 3
    assert session_tokens("\udcff\udcfesession", 16) != session_tokens("session", 16)


def test_session_tokens_are_deterministic_per_key():
    assert session_tokens("alice", 400) == session_tokens("alice", 400)
    assert len(session_tokens("alice", 400)) == 400 and session_tokens("x", 0) == []
    assert session_tokens("alice", 16) != session_tokens("bob", 16)


def test_config_defaults_and_validation():
    cfg = BackendConfig(gpu_class="a10")
    assert cfg.gpu_memory_total_mib == 24576
    assert cfg.engine == "llm" and cfg.model == "llama-3.1-8b" and cfg.prefix_caching and cfg.block_size == 16
    assert cfg.max_concurrency is None and cfg.max_num_batched_tokens is None
    assert BackendConfig(gpu_memory_mib=40000).gpu_memory_total_mib == 40000
    for bad in (
        {"gpu_class": "v100"},
        {"engine": "tgi"},
        {"model": "gpt-5"},
        {"engine": "job", "gpu_memory_mib": 1000},
        {"long_tail": 1.5},
        {"time_scale": 0},
        {"max_concurrency": 0},
        {"max_num_batched_tokens": 0},
        {"block_size": 0},
        {"session_history_tokens": -1},
    ):
        with pytest.raises(ValueError):
            BackendConfig(**bad)
