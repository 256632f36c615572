"""What a lab workload is: a seeded generator of requests (drafts) and their arrival times.

A workload yields ``(arrival_s, Draft)`` in time order for a QPS and a duration. A draft is a
request without the harness's id and time: its prompt, the output length the engine will
produce, the headers and body fields a client sends. A multi-turn session's later turns are
not scheduled up front: a draft carries its session's next turn (:class:`FollowUp`), which the
harness sends ``think_s`` after this turn ends (a user reads the answer or the error, then types),
so a chat's pace follows the latency its router gives it, as it does for real users.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from bench.lab.policy import Prompt

__all__ = ["Draft", "FollowUp", "Sizing", "Workload", "poisson"]


class FollowUp(NamedTuple):
    """A session's next turn: sent ``think_s`` after the turn that carries it ends, whether it was
    answered or failed (an error, an OOM, a rejection), as ``inferlb bench quality``'s open-loop
    trace sends every turn and a chat's user, shown an error, asks again and goes on: the offered
    load does not depend on the policy's errors. ``draft()`` builds it then (its history holds the
    previous turn and the reply it was to have, answered or not, as the real path's resent history
    does; None: the session ends there, e.g. its history would pass the model's context). A turn
    never answered (held or unfinished at the run's end) sends no next turn."""

    think_s: float
    draft: Callable[[], Draft | None]


class Draft(NamedTuple):
    """One request as a client would send it (the harness adds the id, the time and ``x-request-id``).

    Attributes:
        prompt: the prompt.
        output_tokens: how many tokens the engine generates for it (the truth; no policy sees it).
        max_tokens: the body's ``max_tokens`` (None: not sent).
        headers: extra request headers, lower-case name -> value bytes (session, version, memory).
        model: the body's ``model`` (None: not sent).
        user: the body's ``user`` (None: not sent).
        memory_mib: a ``job`` request's GPU memory (MiB; None for ``llm`` requests).
        session: the session it belongs to (for the figures; None: a single request).
        next: the session's next turn (None: the last, or a single request).
        output_ids: the token ids the engine generates, ``output_tokens`` of them (a replayed chat's
            real reply, resent in the next turn's history; None: the engine's own).
    """

    prompt: Prompt
    output_tokens: int
    max_tokens: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    model: str | None = None
    user: str | None = None
    memory_mib: float | None = None
    session: int | None = None
    next: FollowUp | None = None
    output_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Sizing:
    """What a workload may size itself on: the cluster's KV cache (tokens, summed over its engines),
    its engine count and the largest prompt + output an engine takes (tokens)."""

    kv_tokens: int
    engines: int
    max_model_len: int = 32768


class Workload(Protocol):
    """A seeded request generator (one module per workload in ``bench/lab/workloads/``)."""

    name: str

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        """Requests arriving in ``[0, duration_s)`` at a mean of ``qps`` per second (a session's
        later turns included in that mean, though they come through :attr:`Draft.next`), in time
        order. Deterministic for the same ``rng`` state."""
        ...


def poisson(rng: random.Random, rate: float, start: float, end: float,
            factor: Callable[[float], float] | None = None, peak: float = 1.0) -> Iterator[float]:
    """Arrival times of a Poisson process of mean ``rate`` per s in ``[start, end)``; with ``factor``
    (the rate multiplier at a time, at most ``peak``), thinned to follow it (Lewis and Shedler 1979)."""
    if rate <= 0:
        return
    top = rate * peak
    t = start
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return
        if factor is None or rng.random() < rate * factor(t) / top:
            yield t
