"""The seeded request trace of a scenario (pure: the same seed gives the same trace).

Sessions arrive as a Poisson process (thinned to follow bursts); each has a number of turns drawn
from the scenario's range, separated by exponential think times. Sessions also start before 0,
so the trace is in steady state from its first second (turns before 0 are dropped). Requests
without a session arrive as their own Poisson process. A session keeps its version and its tenant
for all turns; each request draws its memory class and whether it is streamed.

:func:`to_planned` turns the trace into OpenAI chat requests: the prompt text starts with the run's
key (one per policy and round), so no run finds prefixes that another one left in the KV caches.
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
    ``memory_mib``: the ``x-sim-memory-mib`` header (None = none). ``tenant``: whose system prompt
    it carries (None = the app's, if any); ``stream``: sent streamed.
    """

    at_s: float
    session: int | None
    turn: int
    version: str | None
    memory_mib: float | None
    tenant: int | None = None
    stream: bool = False


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
    def tenant() -> int | None:
        return rng.randrange(traffic.tenants) if traffic.tenants else None

    def stream() -> bool:
        return rng.random() < traffic.stream_share

    for idx, start in enumerate(_arrivals(rng, session_rps, -lead, duration_s, traffic)):
        version = _pick(rng, traffic.versions)
        owner = tenant()
        t = start
        for turn in range(rng.randint(lo, hi)):
            if turn:
                t += rng.expovariate(1.0 / traffic.think_s)
            if t >= duration_s:
                break
            memory = _pick(rng, traffic.memory_mib)
            streamed = stream()
            if t >= 0:
                out.append(TraceRequest(t, idx, turn, version, memory, owner, streamed))
    anon_rps = traffic.rps * traffic.anon_share
    for t in _arrivals(rng, anon_rps, 0.0, duration_s, traffic):
        out.append(TraceRequest(t, None, 0, _pick(rng, traffic.versions), _pick(rng, traffic.memory_mib), tenant(),
                                stream()))
    out.sort(key=lambda r: r.at_s)
    return out


def session_key(prefix: str, session: int) -> str:
    """The ``x-session-id`` of session ``session`` in a run whose keys start with ``prefix``."""
    return f"{prefix}-s{session:05d}"


_FILLER = ("the quick brown fox jumps over the lazy dog while the model server keeps its cache warm and "
           "answers every question with care ")


def text_of(head: str, tokens: int) -> str:
    """``head`` then filler, cut to ``tokens`` tokens of the sim's tokenizer (4 bytes each), ASCII."""
    size = max(len(head), 4 * tokens)
    body = head + _FILLER * (size // len(_FILLER) + 1)
    return body[:size]


def messages_of(r: TraceRequest, key_prefix: str, traffic: Traffic) -> list[dict[str, str]]:
    """The chat messages of trace request ``r`` in the run ``key_prefix`` (see :class:`Traffic`)."""
    out: list[dict[str, str]] = []
    if traffic.system_tokens:
        owner = "app" if r.tenant is None else f"tenant {r.tenant:03d}"
        out.append({"role": "system", "content": text_of(f"[{key_prefix}] system prompt of {owner}: ",
                                                         traffic.system_tokens)})
    who = f"s{r.session:05d}" if r.session is not None else f"single@{r.at_s:.6f}"
    first = r.turn if not traffic.resend or r.session is None else 0
    for turn in range(first, r.turn + 1):
        size = traffic.opening_tokens if turn == 0 and traffic.opening_tokens else traffic.user_tokens
        out.append({"role": "user", "content": text_of(f"[{key_prefix}] {who} turn {turn}: ", size)})
        if turn < r.turn:
            out.append({"role": "assistant", "content": " ".join(["Simulated", "reply", "from"] * traffic.max_tokens)
                        [: 4 * traffic.max_tokens]})
    return out


def to_planned(trace: Sequence[TraceRequest], key_prefix: str, traffic: Traffic) -> list[Planned]:
    """The trace as load-generator requests of the run ``key_prefix`` (one per policy and round, so no
    run finds sessions or KV caches another run warmed): session keys and prompts start with it."""
    out = []
    for r in trace:
        key = None if r.session is None or not traffic.session_header else session_key(key_prefix, r.session)
        headers = {} if r.memory_mib is None else {MEMORY_HEADER: f"{r.memory_mib:.0f}"}
        out.append(Planned(r.at_s, Session(key, r.version), headers, traffic.max_tokens,
                           messages_of(r, key_prefix, traffic), r.stream))
    return out
