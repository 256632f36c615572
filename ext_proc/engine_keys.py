"""A prompt's KV block keys as the engine computes them, for the precise prefix-cache index (pure).

The precise index (:class:`ext_proc.prefix_events.EventIndex`) holds the block hashes an engine's
KV-cache events name, so the picker must key a request's prompt exactly as that engine does: the
same text from the body (its chat template), the same token ids (its tokenizer), the same blocks
(its ``block_size``) and the same hash chain. llm-d's precise scorer and Dynamo's KV router do this
for vLLM with the model's tokenizer; this module does it for one engine rule, the ``llm`` simulator's
(``inferlb sim-backend``, whose rule it restates: the picker library does not import the simulator,
and ``tests/unit/ext_proc/test_engine_keys.py`` checks both agree on random bodies):

- **Text** (:func:`render_prompt`, the simulator's ``sim.protocol.render_prompt``): a chat body's
  messages each as ``<|ROLE|>\\nCONTENT\\n`` (content parts: their texts joined; other content as
  JSON), then ``<|assistant|>\\n``; a completion's ``prompt`` string (a list as JSON).
- **Tokens** (``sim.tokens.tokenize``'s built-in rule): every :data:`BYTES_PER_TOKEN` bytes of the
  UTF-8 text are one token, its id the CRC-32 of those bytes modulo :data:`VOCAB_SIZE`; or, for a
  simulator run with ``--tokenizer DIR``, the ids of the Hugging Face tokenizer in ``DIR``
  (:func:`load_encoder`, as ``sim.tokenizer.load`` reads it).
- **Keys** (``sim.engines.kv.chain_hashes``): key ``i`` = Python's ``hash((key_(i-1), block_i))``,
  ``block_i`` the tuple of block ``i``'s token ids, key ``-1`` = 0; full blocks only. Python's hash of
  an int tuple does not depend on ``PYTHONHASHSEED`` (CPython 3.8+'s xxHash-based tuple hash).

:func:`engine_keys` renders in Python and does the rest in one call of the compiled
``ext_proc._wire.engine_keys`` (CRC-32 by table, CPython's tuple hash restated in C), else in Python
(:func:`engine_keys_py`, the reference); with a tokenizer, the tokenizer's ``encode`` and the chain
in Python (the tokenizer costs far more than the chain).

For vLLM (``picker.kv_events.keys: vllm``), :func:`vllm_keys`: the token ids as vLLM's OpenAI server
makes them (the model's chat template and tokenizer, :func:`load_vllm_keys`), chained with
:func:`chain_keys`: the picker's own keys, which :class:`ext_proc.own_keys.OwnKeys` also gives the
blocks of vLLM's events from the token ids they carry, so vLLM's own block hash (sha256 or a seeded
builtin hash) is never reproduced.

Not covered: a request with a session key on a simulator that prepends a session's history
(``session_history_tokens``): docs/picker.md, "Precise mode".
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path

__all__ = ["BYTES_PER_TOKEN", "VOCAB_SIZE", "chain_keys", "engine_keys", "engine_keys_py", "load_encoder",
           "load_vllm_keys", "render_prompt", "tokens_of", "vllm_keys"]

#: Bytes of prompt text per token, and the vocabulary the token ids fall in: the simulator's rule.
BYTES_PER_TOKEN = 4
VOCAB_SIZE = 32000

try:
    from ext_proc._wire import engine_keys as _compiled
except ImportError:  # the extension is not built: engine_keys_py
    _compiled = None


def render_prompt(doc: Mapping[str, object]) -> str | None:
    """The text the simulator's tokenizer reads from an OpenAI body (a chat body: one with
    ``messages``); None where the simulator answers 400 (malformed ``messages`` or ``prompt``)."""
    if "messages" in doc:
        messages = doc["messages"]
        if not isinstance(messages, list):
            return None
        parts = []
        for msg in messages:
            if not isinstance(msg, dict):
                return None
            content = msg.get("content", "")
            role = msg.get("role", "user")
            if isinstance(content, list) and content and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in content):
                content = "".join(p["text"] for p in content)
            parts.append(f"<|{role if isinstance(role, str) else 'user'}|>\n"
                         f"{content if isinstance(content, str) else json.dumps(content)}\n")
        return "".join(parts) + "<|assistant|>\n"
    prompt = doc.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return json.dumps(prompt)
    return None


def tokens_of(raw: bytes) -> list[int]:
    """The token ids of UTF-8 text ``raw`` under the simulator's built-in rule (the last may be shorter)."""
    return [zlib.crc32(raw[i:i + BYTES_PER_TOKEN]) % VOCAB_SIZE for i in range(0, len(raw), BYTES_PER_TOKEN)]


def chain_keys(tokens: Sequence[int], block_size: int, start: int = 0) -> tuple[int, ...]:
    """The chained keys of ``tokens``' full blocks of ``block_size`` (signed 64-bit ints); ``start``:
    the key before the first block (0 at a prompt's start; a parent's key for blocks that follow it).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out = []
    prev = start
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        prev = hash((prev, tuple(tokens[i:i + block_size])))
        out.append(prev)
    return tuple(out)


_SURROGATE = re.compile("[\ud800-\udfff]")


@cache
def load_encoder(directory: str) -> Callable[[str], list[int]]:
    """The ``encode`` of the Hugging Face tokenizer in ``directory`` (its ``tokenizer.json``), as the
    simulator's ``--tokenizer`` reads it: text -> token ids, no special tokens added, a lone surrogate
    read as U+FFFD. Loaded once per directory (the picker loads it at start:
    :func:`ext_proc.kv_events.start_feed`).

    Raises:
        ModuleNotFoundError: the ``tokenizers`` package is not installed.
        ValueError: no readable ``tokenizer.json`` there (the message names the file).
    """
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception for a missing or bad file
        raise ValueError(f"{path}: not a Hugging Face tokenizer file ({err})") from None

    def encode(text: str) -> list[int]:
        try:
            return tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate: not a str the tokenizer takes
            return tokenizer.encode(_SURROGATE.sub("\ufffd", text), add_special_tokens=False).ids

    return encode


def _encoded(doc: Mapping[str, object]) -> bytes | None:
    text = render_prompt(doc)
    return None if text is None else text.encode("utf-8", "surrogatepass")


def engine_keys_py(doc: Mapping[str, object], block_size: int) -> tuple[int, ...]:
    """The block keys the simulator's KV cache gives the prompt of body ``doc`` (see the module
    docstring), in Python: the reference of :func:`engine_keys`. ``()``: no full block, or a body the
    simulator refuses.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    raw = _encoded(doc)
    return () if raw is None else chain_keys(tokens_of(raw), block_size)


@cache
def load_vllm_keys(directory: str) -> Callable[[Mapping[str, object]], list[int] | None]:
    """The token ids vLLM's OpenAI server gives a body's prompt, with the model's tokenizer and chat
    template in ``directory`` (its ``tokenizer.json`` and ``tokenizer_config.json``, read by
    ``transformers.AutoTokenizer``, as vLLM reads them). Loaded once per directory. The function
    returns None where it cannot say (the body is malformed or vLLM would refuse it, a chat without a
    template, a part that is not text, a ``cache_salt``, a request's own ``chat_template``).

    As vLLM's server does (``vllm/entrypoints/openai/chat_completion/protocol.py`` for the defaults):

    - a chat body's ``messages`` through the template (``apply_chat_template``, not tokenized) with
      ``add_generation_prompt`` (default true), ``continue_final_message`` (false), ``tools``,
      ``documents`` and ``chat_template_kwargs``, a message's text parts joined by a newline (vLLM's
      ``string`` content format); the text tokenized with ``add_special_tokens`` (default false:
      the template writes them);
    - a completion's ``prompt`` string tokenized with ``add_special_tokens`` (default true); a prompt
      of token ids taken as it is.

    Raises:
        ModuleNotFoundError: the ``transformers`` package is not installed.
        ValueError: ``directory`` holds no tokenizer ``transformers`` can load (the message names it).
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "None of PyTorch ..." line: not needed
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError or its own for a bad directory
        raise ValueError(f"{directory}: not a Hugging Face tokenizer directory ({err})") from None
    template = tokenizer.chat_template

    def encode(text: str, special: object, default: bool) -> list[int] | None:
        try:
            return tokenizer.encode(text, add_special_tokens=default if special is None else special is True)
        except Exception:  # a lone surrogate: not a str the tokenizer takes
            return None

    def chat(doc: Mapping[str, object], messages: list[object]) -> list[int] | None:
        if not template or doc.get("chat_template") is not None:
            return None
        conversation = []
        for msg in messages:
            if not isinstance(msg, dict):
                return None
            content = msg.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    return None  # images, audio: their blocks carry extra keys the picker cannot key
                msg = {**msg, "content": "\n".join(p["text"] for p in content)}
            conversation.append(msg)
        extra = doc.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            return None
        try:
            text = tokenizer.apply_chat_template(
                conversation, tools=doc.get("tools"), documents=doc.get("documents"), tokenize=False,
                add_generation_prompt=doc.get("add_generation_prompt", True) is not False,
                continue_final_message=doc.get("continue_final_message", False) is True, **extra)
        except Exception:  # the template's own raise_exception, a kwarg it does not take: vLLM answers 400
            return None
        return encode(text, doc.get("add_special_tokens"), False) if isinstance(text, str) else None

    def tokens(doc: Mapping[str, object]) -> list[int] | None:
        if doc.get("cache_salt") is not None:
            return None
        if "messages" in doc:
            messages = doc["messages"]
            return chat(doc, messages) if isinstance(messages, list) else None
        prompt = doc.get("prompt")
        if isinstance(prompt, str):
            return encode(prompt, doc.get("add_special_tokens"), True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None

    return tokens


def vllm_keys(doc: Mapping[str, object], block_size: int, tokenizer: str) -> tuple[int, ...]:
    """The picker's own keys of the KV blocks vLLM gives the prompt of body ``doc``: its token ids
    (:func:`load_vllm_keys` of ``tokenizer``) chained per block (:func:`chain_keys`), the keys
    :class:`ext_proc.own_keys.OwnKeys` gives the blocks of vLLM's events. ``()``: no full block, or
    a body it cannot key.

    Raises:
        ValueError: ``block_size`` < 1, or the tokenizer cannot be loaded.
        ModuleNotFoundError: the ``transformers`` package is not installed.
    """
    ids = load_vllm_keys(tokenizer)(doc)
    return () if ids is None else chain_keys(ids, block_size)


def engine_keys(doc: Mapping[str, object], block_size: int, tokenizer: str | None = None,
                rule: str = "sim") -> tuple[int, ...]:
    """:func:`engine_keys_py` with the tokens and keys in one compiled call (a 20 KiB chat prompt:
    docs/picker.md, "Precise mode"); with ``tokenizer`` (a directory: :func:`load_encoder`), the
    tokens are that tokenizer's; with ``rule`` ``vllm`` (and a ``tokenizer``), :func:`vllm_keys`.

    Raises:
        ValueError: ``block_size`` < 1, or the tokenizer cannot be loaded.
        ModuleNotFoundError: ``tokenizer`` given and the ``tokenizers`` package (``transformers``
            for ``vllm``) not installed.
    """
    if tokenizer is not None:
        if rule == "vllm":
            return vllm_keys(doc, block_size, tokenizer)
        text = render_prompt(doc)
        return () if text is None else chain_keys(load_encoder(tokenizer)(text), block_size)
    if _compiled is None:
        return engine_keys_py(doc, block_size)
    raw = _encoded(doc)
    return () if raw is None else _compiled(raw, BYTES_PER_TOKEN, VOCAB_SIZE, block_size)
