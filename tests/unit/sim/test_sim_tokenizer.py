"""The simulator's tokenizer on disk (sim/tokenizer.py): the small tokenizer it writes, counting with
it (``inferlb sim-backend --tokenizer DIR``), and a server's usage agreeing with a client that counts
with the same files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from sim import tokens
from sim.cli import sim_backend, sim_tokenizer
from sim.config import BackendConfig
from sim.protocol import render_prompt
from sim.server import start_backend
from sim.tokenizer import END_OF_TEXT, load, write_small_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_small_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def counting(tok_dir) -> Iterator[None]:
    """The process counts with the small tokenizer during the test, with the built-in rule after."""
    tokens.use_tokenizer(load(tok_dir))
    yield
    tokens.use_tokenizer(None)


def test_the_small_tokenizer_is_the_same_files_every_time_and_loads_as_transformers_expects(tok_dir, tmp_path):
    again = write_small_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tok_dir / name).read_bytes(), name
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == END_OF_TEXT
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert 1000 < tokenizer.get_vocab_size() <= 8192
    text = "The model server answers 12345 requests; Ünïcødé and 日本語 too!"
    ids = load(tok_dir)(text)
    assert tokenizer.decode(ids) == text   # byte-level: any text, no unknown token
    assert END_OF_TEXT not in tokenizer.decode(ids, skip_special_tokens=False)   # no special token added


def test_a_lone_surrogate_counts_as_a_replacement_character_not_an_error(tok_dir):
    encode = load(tok_dir)
    assert encode("a\ud800b") == encode("a\ufffdb")


def test_counting_with_a_tokenizer_replaces_four_bytes_a_token(counting, tok_dir):
    text = "Hello world, this is a simple sentence about the water and the sun."
    assert tokens.tokenize(text) == load(tok_dir)(text)
    assert tokens.estimate_tokens(text) == len(load(tok_dir)(text))


def test_openai_content_parts_are_read_as_their_text():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                       {"type": "text", "text": "there"}]}]}
    plain = {"messages": [{"role": "user", "content": "Hello there"}]}
    assert render_prompt("chat", parts) == render_prompt("chat", plain)


async def test_the_servers_usage_is_the_count_a_client_with_the_same_files_makes(counting, tok_dir):
    runner, port = await start_backend(BackendConfig(host="127.0.0.1", port=0, seed=1, time_scale=0.01))
    try:
        body = {"max_tokens": 2, "messages": [{"role": "system", "content": "You are a terse assistant."},
                                              {"role": "user", "content": "Name three rivers in Europe."}]}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
    finally:
        await runner.cleanup()
    client_count = len(load(tok_dir)(render_prompt("chat", body)))
    assert usage["prompt_tokens"] == client_count


def test_the_commands_write_and_use_the_directory(tmp_path, monkeypatch):
    out = tmp_path / "t"
    result = CliRunner().invoke(sim_tokenizer, [str(out), "--vocab-size", "1024"])
    assert result.exit_code == 0, result.output
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 1024
    ran = []
    monkeypatch.setattr("sim.server.run_backend", ran.append)
    try:
        result = CliRunner().invoke(sim_backend, ["--port", "0", "--tokenizer", str(out)])
        assert result.exit_code == 0, result.output
        assert ran and tokens.tokenize("hello world") == load(out)("hello world")
    finally:
        tokens.use_tokenizer(None)
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(sim_backend, ["--port", "0", "--tokenizer", str(empty)])
    assert result.exit_code == 2 and "tokenizer.json" in result.output


def test_a_directory_with_a_chat_template_renders_chats_with_it(tmp_path):
    """``--tokenizer DIR`` with a chat template: chat prompts rendered as vLLM's server renders them
    (the template, the generation prompt, text parts joined by a newline); without one, the built-in rule."""
    from sim.protocol import render_prompt, use_chat_template
    from sim.tokenizer import load_chat_template
    from tests.support.chat_tokenizer import write_chat_tokenizer

    assert load_chat_template(write_small_tokenizer(tmp_path / "plain")) is None
    render = load_chat_template(write_chat_tokenizer(tmp_path / "chatml"))
    assert render is not None
    body = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    use_chat_template(render)
    try:
        assert render_prompt("chat", body) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
                                               "<|im_start|>assistant\n")
        assert render_prompt("completion", {"prompt": "p"}) == "p"
    finally:
        use_chat_template(None)
    assert render_prompt("chat", body) == "<|system|>\nS\n<|user|>\nab\n<|assistant|>\n"
