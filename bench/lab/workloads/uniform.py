"""``uniform``: independent prompts that share nothing (the do-no-harm check).

Every request's prompt is its own random tokens, so no prefix cache can help and a cache-aware
router can only lose by concentrating load. Prompt and output lengths are drawn uniformly from
their ranges. The prompts are slices of one seeded pool of token ids at random offsets: two
requests share a prefix only if they start at the same offset (one chance in the pool's size).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from bench.lab.policy import Message, Prompt
from bench.lab.workloads.base import Draft, Sizing, poisson
from bench.lab.workloads.tokens import CHARS_PER_TOKEN, Synth, render

__all__ = ["Uniform"]


@dataclass
class Uniform:
    """Independent prompts.

    Attributes:
        prompt_tokens: (min, max) prompt length, tokens (uniform).
        output_tokens: (min, max) output length, tokens (uniform).
        pool_tokens: size of the token pool prompts are cut from.
        seed: the pool's seed.
    """

    prompt_tokens: tuple[int, int] = (512, 2048)
    output_tokens: tuple[int, int] = (128, 512)
    pool_tokens: int = 1 << 20
    seed: int = 2
    name: str = "uniform"

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        ids, text = _token_pool(self.seed, self.pool_tokens)
        lo, hi = self.prompt_tokens
        for t in poisson(rng, qps, 0.0, duration_s):
            n = rng.randint(lo, hi)
            start = rng.randrange(len(ids) - n)
            prompt = Prompt((Message("user", text[CHARS_PER_TOKEN * start:CHARS_PER_TOKEN * (start + n)],
                                     ids[start:start + n]),))
            out = rng.randint(*self.output_tokens)
            yield t, Draft(prompt, out, out)


@lru_cache(maxsize=2)
def _token_pool(seed: int, n: int) -> tuple[tuple[int, ...], str]:
    """The pool of ``n`` token ids of ``seed`` and its text (:func:`~bench.lab.workloads.tokens.render`:
    :data:`~bench.lab.workloads.tokens.CHARS_PER_TOKEN` characters per id, so a slice of ids and the
    same slice of the text go together), made once per process: a prompt is two slices."""
    ids = Synth(seed).ids(n)
    return ids, render(np.asarray(ids, dtype=np.int64))
