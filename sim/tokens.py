"""Tokenization: prompt text to token ids, in one place behind one function boundary.

The simulator's tokenizer is a fixed rule, not a model's: every :data:`BYTES_PER_TOKEN` bytes of
the UTF-8 text are one token (see :func:`tokenize`). Everything that turns text into token ids goes
through this module, so another tokenizer (a real model's) can replace the rule here alone.
"""

from __future__ import annotations

import zlib

#: Bytes of prompt text per token, and the vocabulary the token ids fall in (see :func:`tokenize`).
BYTES_PER_TOKEN = 4
VOCAB_SIZE = 32000


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: every :data:`BYTES_PER_TOKEN` bytes of its UTF-8 form are one token,
    whose id is the CRC-32 of those bytes modulo :data:`VOCAB_SIZE` (the last token may be shorter).

    Deterministic and prefix-preserving: a text that starts with another has the other's tokens
    first (except the other's last, partial token), so a resent conversation hits the prefix cache.
    The empty text has no tokens. Lone surrogates (a JSON ``"\\ud800"``, a header that is not
    UTF-8) are encoded as they are (``surrogatepass``), never an error.
    """
    raw = text.encode("utf-8", "surrogatepass")  # JSON and headers may carry lone surrogates
    return [zlib.crc32(raw[i:i + BYTES_PER_TOKEN]) % VOCAB_SIZE for i in range(0, len(raw), BYTES_PER_TOKEN)]


def estimate_tokens(text: str) -> int:
    """Token count of ``text`` under :func:`tokenize` (at least 1)."""
    return max(1, (len(text.encode("utf-8", "surrogatepass")) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN)


def session_tokens(key: str, n: int) -> list[int]:
    """``n`` token ids that stand for the conversation history of session ``key`` (a client that
    sends a session header but not its history: the session-keyed cache as a special case of the
    prefix cache). Deterministic; different keys give different first blocks."""
    if n <= 0:
        return []
    ids: list[int] = []
    seed = zlib.crc32(key.encode("utf-8", "surrogatepass"))
    while len(ids) < n:
        seed = zlib.crc32(seed.to_bytes(4, "little"), len(ids))
        ids.append(seed % VOCAB_SIZE)
    return ids
