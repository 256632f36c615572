"""Results of one policy run -> the benchmark's figures (pure).

Definitions (all over the *measured* requests: those planned at or after the end of warm-up):
- latency percentiles and mean: client-side, over successful (2xx) requests, ms (nearest rank);
- ``error_rate``: share of requests without a 2xx answer (OOMs, timeouts, 5xx, connection errors);
  ``oom_rate`` and ``timeout_rate``: the OOM (sim's 500 ``oom``) and client-timeout parts of it;
- ``wrong_version``: share of 2xx answers whose ``x-backend-version`` differs from the version asked
  for (no header = the default version); null when the scenario serves a single version;
- ``session_hit_rate``: share of successful session turns, after a session's first answered turn,
  served by a node that had served that session before (its KV cache is warm there: the sim keeps
  an LRU of 10 000 sessions per node); null without sessions;
- ``sessions_moved``: among sessions answered both before a scale-up (``add`` event) and between
  it and the next event, the share whose last node before differs from their last node after;
  null without an ``add`` event;
- ``throughput_rps``: successful requests per second from the first measured send to the last answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.quality.trace import TraceRequest
from inferlb.devstack.loadgen import Result, percentile

FIGURES: tuple[str, ...] = ("p50_ms", "p95_ms", "p99_ms", "error_rate", "oom_rate", "wrong_version",
                            "session_hit_rate", "sessions_moved", "throughput_rps")
EXTRA: tuple[str, ...] = ("mean_ms", "timeout_rate", "requests")


@dataclass(frozen=True)
class RunWindow:
    """Where the measured window is: ``started`` = wall time (s) the replay began; ``warmup_s``;
    ``scale_up_s`` and ``next_event_s``: trace times of the first ``add`` event and of the event
    after it (None when absent); ``default_version``; ``multi_version``: the pool serves several."""

    started: float
    warmup_s: float
    default_version: str
    multi_version: bool
    scale_up_s: float | None = None
    next_event_s: float | None = None


def _ok(r: Result) -> bool:
    return 200 <= r.status < 300


def _rate(n: int, d: int) -> float | None:
    return None if d == 0 else n / d


def compute(trace: Sequence[TraceRequest], results: Sequence[Result], w: RunWindow) -> dict[str, float | None]:
    """The figures of one run (keys :data:`FIGURES` + :data:`EXTRA`; rates 0-1, latencies ms).

    ``results[i].index`` points into ``trace``. Raises ``ValueError`` if a result has no index.
    """
    if any(r.index is None for r in results):
        raise ValueError("every result needs its trace index (use loadgen.replay)")
    measured = [r for r in results if trace[r.index].at_s >= w.warmup_s]  # type: ignore[index]
    ok = [r for r in measured if _ok(r)]
    lat = sorted(r.latency_ms for r in ok)
    n = len(measured)
    out: dict[str, float | None] = {
        "p50_ms": percentile(lat, 50) if lat else None,
        "p95_ms": percentile(lat, 95) if lat else None,
        "p99_ms": percentile(lat, 99) if lat else None,
        "mean_ms": sum(lat) / len(lat) if lat else None,
        "error_rate": _rate(n - len(ok), n),
        "oom_rate": _rate(sum(1 for r in measured if r.error == "oom"), n),
        "timeout_rate": _rate(sum(1 for r in measured if r.error == "timeout"), n),
        "wrong_version": None,
        "session_hit_rate": session_hit_rate(trace, results, w.warmup_s),
        "sessions_moved": None,
        "throughput_rps": None,
        "requests": n,
    }
    if w.multi_version:
        wrong = sum(1 for r in ok if r.backend_version != (r.session.version or w.default_version))
        out["wrong_version"] = _rate(wrong, len(ok))
    if w.scale_up_s is not None:
        out["sessions_moved"] = sessions_moved(trace, results, w.scale_up_s, w.next_event_s)
    if ok:
        first_send = w.started + w.warmup_s
        span = max(r.at for r in ok) - first_send
        out["throughput_rps"] = len(ok) / span if span > 0 else None
    return out


def _answered_in_order(trace: Sequence[TraceRequest], results: Sequence[Result]) -> list[tuple[TraceRequest, Result]]:
    """Successful session requests with their trace entries, in trace (turn) order."""
    pairs = [(trace[r.index], r) for r in results if _ok(r) and r.served_by]  # type: ignore[index]
    pairs = [(t, r) for t, r in pairs if t.session is not None]
    pairs.sort(key=lambda p: (p[0].at_s, p[0].turn))
    return pairs


def session_hit_rate(trace: Sequence[TraceRequest], results: Sequence[Result], warmup_s: float) -> float | None:
    """See the module docstring. Turns before ``warmup_s`` build the history but are not counted."""
    seen: dict[int, set[str]] = {}
    hits = counted = 0
    for t, r in _answered_in_order(trace, results):
        nodes = seen.setdefault(t.session, set())  # type: ignore[arg-type]
        if nodes and t.at_s >= warmup_s:
            counted += 1
            hits += r.served_by in nodes
        nodes.add(r.served_by)  # type: ignore[arg-type]
    return _rate(hits, counted)


def sessions_moved(trace: Sequence[TraceRequest], results: Sequence[Result], at_s: float,
                   until_s: float | None) -> float | None:
    """See the module docstring: the share of sessions whose node changed across the scale-up at ``at_s``."""
    before: dict[int, str] = {}
    after: dict[int, str] = {}
    for t, r in _answered_in_order(trace, results):
        if t.at_s < at_s:
            before[t.session] = r.served_by  # type: ignore[index,assignment]
        elif until_s is None or t.at_s < until_s:
            after[t.session] = r.served_by  # type: ignore[index,assignment]
    both = [s for s in after if s in before]
    return _rate(sum(1 for s in both if before[s] != after[s]), len(both))
