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

Not covered: a request with a session key on a simulator that prepends a session's history
(``session_history_tokens``), and vLLM's own keys (the model's chat template and tokenizer, vLLM's
``sha256`` or seeded ``builtin`` block hash): docs/picker.md, "Precise mode".
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path

__all__ = ["BYTES_PER_TOKEN", "VOCAB_SIZE", "chain_keys", "engine_keys", "engine_keys_py", "load_encoder",
           "render_prompt", "tokens_of"]

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


def chain_keys(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The chained keys of ``tokens``' full blocks of ``block_size`` (signed 64-bit ints).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out = []
    prev = 0
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


def engine_keys(doc: Mapping[str, object], block_size: int, tokenizer: str | None = None) -> tuple[int, ...]:
    """:func:`engine_keys_py` with the tokens and keys in one compiled call (a 20 KiB chat prompt:
    docs/picker.md, "Precise mode"); with ``tokenizer`` (a directory: :func:`load_encoder`), the
    tokens are that tokenizer's.

    Raises:
        ValueError: ``block_size`` < 1, or the tokenizer cannot be loaded.
        ModuleNotFoundError: ``tokenizer`` given and the ``tokenizers`` package not installed.
    """
    if tokenizer is not None:
        text = render_prompt(doc)
        return () if text is None else chain_keys(load_encoder(tokenizer)(text), block_size)
    if _compiled is None:
        return engine_keys_py(doc, block_size)
    raw = _encoded(doc)
    return () if raw is None else _compiled(raw, BYTES_PER_TOKEN, VOCAB_SIZE, block_size)
