"""The seeded request trace of a scenario (pure: the same seed gives the same trace).

Sessions arrive as a Poisson process (thinned to follow bursts); each has a number of turns drawn
from the scenario's range, separated by exponential think times. Sessions also start before 0,
so the trace is in steady state from its first second (turns before 0 are dropped). Requests
without a session arrive as their own Poisson process. A session keeps its version for all turns;
each request draws its memory class.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.quality.scenarios import Traffic
from inferlb.devstack.loadgen import Planned, Session

MEMORY_HEADER = "x-sim-memory-mib"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One planned request: sent ``at_s`` after the trace starts.

    ``session``: index of its session (None = no session header); ``turn``: 0-based turn number in
    its session (0 for single requests). ``version``: the version header (None = none).
    ``memory_mib``: the ``x-sim-memory-mib`` header (None = none).
    """

    at_s: float
    session: int | None
    turn: int
    version: str | None
    memory_mib: float | None


def _pick(rng: random.Random, choices: Sequence[tuple[object, float]]):
    values, shares = zip(*choices, strict=True)
    return rng.choices(values, weights=shares)[0]


def _rate_factor(t: float, traffic: Traffic) -> float:
    """Arrival-rate multiplier at ``t``, so that its mean over a burst period is 1."""
    if traffic.burst is None:
        return 1.0
    period, on, factor = traffic.burst
    base = 1.0 / (1.0 + (factor - 1.0) * on / period)
    return base * (factor if (t % period) < on else 1.0)


def _arrivals(rng: random.Random, rate: float, start: float, end: float, traffic: Traffic) -> list[float]:
    """Poisson arrivals of mean ``rate`` per s in [start, end), modulated by the bursts (thinning)."""
    if rate <= 0:
        return []
    peak = rate * (1.0 if traffic.burst is None else max(1.0, _rate_factor(0.0, traffic)))
    out, t = [], start
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return out
        if rng.random() < rate * _rate_factor(t, traffic) / peak:
            out.append(t)


def build_trace(traffic: Traffic, duration_s: float, seed: int) -> list[TraceRequest]:
    """All requests of ``traffic`` in [0, ``duration_s``), sorted by time.

    Mean rate: ``traffic.rps`` requests per second (``anon_share`` of them without a session).
    Raises ``ValueError`` for a non-positive duration or rate, or a bad turn range.
    """
    if duration_s <= 0 or traffic.rps <= 0:
        raise ValueError("duration_s and traffic.rps must be > 0")
    lo, hi = traffic.turns
    if not 1 <= lo <= hi:
        raise ValueError(f"traffic.turns must be 1 <= min <= max, got {traffic.turns}")
    rng = random.Random(seed)
    mean_turns = (lo + hi) / 2
    session_rps = traffic.rps * (1.0 - traffic.anon_share) / mean_turns
    lead = hi * traffic.think_s * 2  # sessions started this long before 0 still have turns after 0
    out: list[TraceRequest] = []
    for idx, start in enumerate(_arrivals(rng, session_rps, -lead, duration_s, traffic)):
        version = _pick(rng, traffic.versions)
        t = start
        for turn in range(rng.randint(lo, hi)):
            if turn:
                t += rng.expovariate(1.0 / traffic.think_s)
            if t >= duration_s:
                break
            memory = _pick(rng, traffic.memory_mib)
            if t >= 0:
                out.append(TraceRequest(t, idx, turn, version, memory))
    anon_rps = traffic.rps * traffic.anon_share
    for t in _arrivals(rng, anon_rps, 0.0, duration_s, traffic):
        out.append(TraceRequest(t, None, 0, _pick(rng, traffic.versions), _pick(rng, traffic.memory_mib)))
    out.sort(key=lambda r: r.at_s)
    return out


def session_key(prefix: str, session: int) -> str:
    """The ``x-session-id`` of session ``session`` in a run whose keys start with ``prefix``."""
    return f"{prefix}-s{session:05d}"


def to_planned(trace: Sequence[TraceRequest], key_prefix: str, max_tokens: int) -> list[Planned]:
    """The trace as load-generator requests; session keys get ``key_prefix`` (one per policy, so no
    policy finds KV caches another policy warmed)."""
    out = []
    for r in trace:
        key = None if r.session is None else session_key(key_prefix, r.session)
        headers = {} if r.memory_mib is None else {MEMORY_HEADER: f"{r.memory_mib:.0f}"}
        out.append(Planned(r.at_s, Session(key, r.version), headers, max_tokens))
    return out
