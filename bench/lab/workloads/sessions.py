"""``sessions``: synthetic chat sessions with the knobs of the seed's traps (``inferlb bench quality``).

The traffic of :class:`bench.quality.scenarios.Traffic` in the lab: sessions of a few turns
separated by think time (after the reply, here), a share of single requests without a session,
each session's model version (a header, or none), each request's declared GPU memory (the
``job`` engine's ``x-sim-memory-mib``), bursts (the arrival rate ``factor`` times higher for
``on`` s of every ``period`` s, the mean kept), a system prompt per tenant or for the whole app,
and the history resent each turn. Messages are synthetic (:class:`~bench.lab.workloads.tokens.Synth`):
a system prompt per tenant made once, a user message and a reply per turn.
"""

from __future__ import annotations

import math
import random
from bisect import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from bench.lab.policy import Message, Prompt
from bench.lab.workloads.base import Draft, FollowUp, Sizing, poisson
from bench.lab.workloads.tokens import Synth
from bench.quality.trace import MEMORY_HEADER

__all__ = ["ChatSessions", "burst_factor"]


def burst_factor(burst: tuple[float, float, float] | None) -> tuple[Callable[[float], float] | None, float]:
    """The rate multiplier over time of ``(period s, on s, factor)`` bursts (mean 1) and its peak;
    ``(None, 1.0)`` without bursts."""
    if burst is None:
        return None, 1.0
    period, on, factor = burst
    base = 1.0 / (1.0 + (factor - 1.0) * on / period)
    return (lambda t: base * (factor if (t % period) < on else 1.0)), base * factor


def _pick(rng: random.Random, choices: Sequence[tuple[object, float]]) -> object:
    """One of ``choices``' values drawn by their shares: ``rng.choices(values, weights=shares)[0]``,
    the same draw and the same arithmetic, with the cumulative shares made once per ``choices``."""
    values, cum, total = _cumulative(tuple(choices))
    return values[bisect(cum, rng.random() * total, 0, len(values) - 1)]


@lru_cache(maxsize=64)
def _cumulative(choices: tuple[tuple[object, float], ...]) -> tuple[tuple[object, ...], list[float], float]:
    values, shares = zip(*choices, strict=True)
    cum = list(accumulate(shares))
    total = cum[-1] + 0.0
    if not 0.0 < total < math.inf:
        raise ValueError(f"the shares must add up to a positive finite number, got {shares}")
    return values, cum, total


@dataclass
class ChatSessions:
    """Chat sessions and single requests, as the seed's trap scenarios send them.

    Attributes:
        anon_share: share of requests without a session (single requests).
        turns: (min, max) turns per session (uniform).
        think_s: mean think time after a reply (s, exponential).
        versions: (version header value or None, share) per session.
        memory_mib: (declared MiB or None, share) per request (``job`` engines).
        burst: (period s, on s, factor) bursts, None: a steady rate.
        output_tokens: tokens generated per request.
        system_tokens: the system prompt (tokens; 0: none), one per tenant when ``tenants`` > 0.
        tenants: tenants (each session or single request belongs to one, uniformly); 0: one app.
        user_tokens: each user message (tokens).
        opening_tokens: the first user message of a session or single request (tokens; 0: ``user_tokens``):
            the conversation's own context, shared with no other conversation.
        resend: each turn carries the session's earlier turns (OpenAI-style clients).
        session_header: sessions send ``x-session-id``.
        seed: the messages' seed.
    """

    anon_share: float = 0.0
    turns: tuple[int, int] = (4, 12)
    think_s: float = 0.6
    versions: tuple[tuple[str | None, float], ...] = ((None, 1.0),)
    memory_mib: tuple[tuple[float | None, float], ...] = ((None, 1.0),)
    burst: tuple[float, float, float] | None = None
    output_tokens: int = 16
    system_tokens: int = 300
    tenants: int = 0
    user_tokens: int = 40
    opening_tokens: int = 0
    resend: bool = True
    session_header: bool = True
    seed: int = 3
    name: str = "sessions"
    _synth: Synth | None = field(default=None, repr=False)
    _systems: dict[int, Message] = field(default_factory=dict, repr=False)

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            raise ValueError(f"sessions: turns must be 1 <= min <= max, got {self.turns}")
        self._synth = Synth(self.seed)
        factor, peak = burst_factor(self.burst)
        session_rate = qps * (1.0 - self.anon_share) / ((lo + hi) / 2)
        starts = [(t, True) for t in poisson(rng, session_rate, 0.0, duration_s, factor, peak)]
        starts += [(t, False) for t in poisson(rng, qps * self.anon_share, 0.0, duration_s, factor, peak)]
        starts.sort()
        for n, (t, session) in enumerate(starts):
            version = _pick(rng, self.versions)
            tenant = rng.randrange(self.tenants) if self.tenants else 0
            turns = rng.randint(lo, hi) if session else 1
            seed = rng.getrandbits(64)  # the session's own: its turns do not depend on other sessions' timing
            yield t, self._turn(n if session else None, version, tenant, (), 0, turns,  # type: ignore[arg-type]
                                random.Random(seed), Synth(seed))

    def _system(self, tenant: int) -> tuple[Message, ...]:
        if not self.system_tokens:
            return ()
        made = self._systems.get(tenant)
        if made is None:
            assert self._synth is not None
            made = self._systems[tenant] = self._synth.message("system", self.system_tokens)
        return (made,)

    def _turn(self, session: int | None, version: str | None, tenant: int, history: tuple[Message, ...],
              turn: int, turns: int, rng: random.Random, synth: Synth) -> Draft:
        question = synth.message("user", self.opening_tokens if turn == 0 and self.opening_tokens else self.user_tokens)
        earlier = history if self.resend else ()
        prompt = Prompt((*self._system(tenant), *earlier, question))
        headers: list[tuple[str, bytes]] = []
        if session is not None and self.session_header:
            headers.append(("x-session-id", f"s{session:06d}".encode()))
        if version is not None:
            headers.append(("model-version", version.encode()))
        memory = _pick(rng, self.memory_mib)
        if memory is not None:
            headers.append((MEMORY_HEADER, f"{memory:.0f}".encode()))
        follow = None
        if session is not None and turn + 1 < turns:
            reply = synth.message("assistant", self.output_tokens)
            follow = FollowUp(rng.expovariate(1.0 / self.think_s),
                              lambda: self._turn(session, version, tenant, (*history, question, reply), turn + 1,
                                                 turns, rng, synth))
        return Draft(prompt, self.output_tokens, self.output_tokens, tuple(headers),
                     memory_mib=memory, session=session, next=follow)  # type: ignore[arg-type]
