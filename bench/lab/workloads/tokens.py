"""Prompts that are cheap to build at 36 000 requests per QPS point: messages made once, shared.

Synthetic messages (:class:`Synth`) draw their token ids with numpy from a seeded generator and
render each id as four ASCII characters, so a router that reads text (llm-d's and SGLang's
approximate prefix matching, inferlb's prefix key and its chars-per-token estimate of 4) sees
exactly the prefixes the engine's token ids share. Real text (ShareGPT, a trace's prompts) is
tokenized by :class:`Tokenizer`, each distinct text once.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from operator import itemgetter

import numpy as np

from bench.lab.policy import Message, Prompt
from sim.engines.kv import ROOT_HASH, chain_hashes
from sim.tokens import VOCAB_SIZE, tokenize

__all__ = ["CHARS_PER_TOKEN", "Synth", "Tokenizer", "prompt_keys", "render"]

#: Characters per synthetic token: three base-36 digits and a space.
CHARS_PER_TOKEN = 4
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
#: One int object per id, shared by every message (a message's tuple holds pointers, not new ints).
_IDS = tuple(range(VOCAB_SIZE))
_TABLE = np.array([(_DIGITS[i // 1296] + _DIGITS[i // 36 % 36] + _DIGITS[i % 36] + " ").encode()
                   for i in range(VOCAB_SIZE)], dtype="S4")


def render(ids: np.ndarray) -> str:
    """The text of token ids (four characters each; distinct ids below the vocabulary's size, distinct
    words; larger ids wrap around)."""
    return _TABLE[ids % VOCAB_SIZE].tobytes().decode("ascii")


class Synth:
    """Synthetic messages from one seeded generator: :meth:`message` of ``n`` random token ids.

    Args:
        seed: the generator's seed (the same seed and calls give the same messages).
    """

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def message(self, role: str | None, n: int) -> Message:
        """A message of ``n`` (>= 1) random token ids and their rendered text."""
        ids = self._rng.integers(0, VOCAB_SIZE, size=max(1, n), dtype=np.int64)
        return Message(role, render(ids), _shared(ids.tolist()))

    def ids(self, n: int) -> tuple[int, ...]:
        """``n`` random token ids."""
        return _shared(self._rng.integers(0, VOCAB_SIZE, size=n, dtype=np.int64).tolist())


def _shared(ids: list[int]) -> tuple[int, ...]:
    """``ids`` (below the vocabulary's size) as a tuple of the shared int objects of :data:`_IDS`."""
    return itemgetter(*ids)(_IDS) if len(ids) > 1 else tuple(_IDS[i] for i in ids)  # itemgetter(i): no tuple


class Tokenizer:
    """The engines' tokenizer (:func:`sim.tokens.tokenize`) with a cache: each distinct text is
    tokenized once per instance."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = tuple(tokenize(text)) or (0,)
        return ids

    def message(self, role: str | None, text: str) -> Message:
        """A message of ``text`` with its token ids."""
        return Message(role, text, self(text))


_KEYS: weakref.WeakKeyDictionary[Prompt, tuple[int, tuple[int, ...]]] = weakref.WeakKeyDictionary()
#: Keys of recent prompts' leading messages: ``(block size, messages) -> keys of the full blocks of their
#: tokens``, the oldest dropped beyond :data:`_PREFIXES_KEPT` (a chat's next turn extends its last prompt,
#: a group's prompts share their first message: their keys are hashed once).
_PREFIXES: OrderedDict[tuple[int, tuple[Message, ...]], tuple[int, ...]] = OrderedDict()
_PREFIXES_KEPT = 4096


def prompt_keys(prompt: Prompt, block_size: int) -> tuple[int, ...]:
    """The engines' keys of ``prompt``'s full blocks of ``block_size`` tokens
    (:func:`sim.engines.kv.chain_hashes`), made once per prompt object and kept while it lives: a
    prompt sent many times (a shared prefix's users) is hashed once for the engines
    (:attr:`sim.engines.api.EngineRequest.block_keys`) and the routers that key it (Dynamo's, the oracle).
    Only the blocks past the longest run of its leading messages whose keys a recent prompt made
    (the whole of an earlier prompt, or its first message) are hashed: keys are chained, so the
    blocks of a shared run of tokens have the same keys in every prompt that starts with it."""
    got = _KEYS.get(prompt)
    if got is None or got[0] != block_size:
        messages = prompt.messages
        known: tuple[int, ...] = ()
        for n in range(len(messages) - 1, 0, -1):
            known = _PREFIXES.get((block_size, messages[:n]), ())
            if known:
                break
        keys = (*known, *chain_hashes(prompt.token_ids, block_size, start=len(known),
                                      parent=known[-1] if known else ROOT_HASH))
        got = _KEYS[prompt] = (block_size, keys)
        _remember((block_size, messages), keys)
        if len(messages) > 1 and (block_size, messages[:1]) not in _PREFIXES:
            _remember((block_size, messages[:1]), keys[:len(messages[0].tokens) // block_size])
    return got[1]


def _remember(prefix: tuple[int, tuple[Message, ...]], keys: tuple[int, ...]) -> None:
    _PREFIXES[prefix] = keys
    if len(_PREFIXES) > _PREFIXES_KEPT:
        _PREFIXES.popitem(last=False)
