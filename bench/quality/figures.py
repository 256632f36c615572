"""Results of one policy run -> the benchmark's figures (pure).

Definitions (all over the *measured* requests: those planned at or after the end of warm-up):
- ``ttft_p*_ms``: time to first token, client-side, over successful *streamed* requests (the time
  to the first content chunk), ms; ``tpot_p*_ms``: time per output token after the first, over
  successful streamed requests with at least two content chunks, ms;
- latency percentiles (``p50_ms`` ...) and mean: end to end, client-side, over successful (2xx)
  requests, ms (nearest rank);
- ``prefix_hit_rate``: prompt tokens the backends found in their prefix caches / prompt tokens they
  looked up, from the backends' own counters (``vllm:prefix_cache_hits`` / ``..._queries``) over the
  measured window; ``preemptions``: requests the backends preempted in it (``vllm:num_preemptions``);
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
- ``throughput_rps``: successful requests per second from the first measured send to the last answer;
  ``output_tokens_per_s``: their output tokens (``usage.completion_tokens``) per second, same span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.quality.trace import TraceRequest
from inferlb.devstack.loadgen import Result, percentile

FIGURES: tuple[str, ...] = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms",
                            "p50_ms", "p95_ms", "p99_ms", "prefix_hit_rate", "error_rate", "oom_rate",
                            "preemptions", "wrong_version", "session_hit_rate", "sessions_moved",
                            "throughput_rps", "output_tokens_per_s")
EXTRA: tuple[str, ...] = ("mean_ms", "timeout_rate", "requests", "streamed", "peak_in_flight")


@dataclass(frozen=True)
class BackendCounters:
    """The backends' counters summed over the nodes, as deltas over the measured window: prompt
    tokens looked up in and found in the prefix caches, preempted requests."""

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0


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


def compute(trace: Sequence[TraceRequest], results: Sequence[Result], w: RunWindow,
            backends: BackendCounters | None = None) -> dict[str, float | None]:
    """The figures of one run (keys :data:`FIGURES` + :data:`EXTRA`; rates 0-1, latencies ms).

    ``results[i].index`` points into ``trace``; ``backends``: the nodes' counters over the measured
    window (None: ``prefix_hit_rate`` and ``preemptions`` are None). Raises ``ValueError`` if a
    result has no index.
    """
    if any(r.index is None for r in results):
        raise ValueError("every result needs its trace index (use loadgen.replay)")
    measured = [r for r in results if trace[r.index].at_s >= w.warmup_s]  # type: ignore[index]
    ok = [r for r in measured if _ok(r)]
    lat = sorted(r.latency_ms for r in ok)
    ttft = sorted(r.ttft_ms for r in ok if r.stream and r.ttft_ms is not None)
    tpot = sorted(r.tpot_ms for r in ok if r.stream and r.tpot_ms is not None)
    n = len(measured)

    def pct(values: list[float], p: float) -> float | None:
        return percentile(values, p) if values else None

    out: dict[str, float | None] = {
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p90_ms": pct(tpot, 90),
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
        "prefix_hit_rate": None if backends is None else _rate(backends.prefix_hit_tokens,
                                                                backends.prefix_queried_tokens),
        "preemptions": None if backends is None else backends.preemptions,
        "throughput_rps": None,
        "output_tokens_per_s": None,
        "requests": n,
        "streamed": sum(1 for r in measured if r.stream),
        "peak_in_flight": None,  # the runner's, from the backends (scenarios with several gateways)
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
        tokens = sum(r.completion_tokens or 0 for r in ok)
        out["output_tokens_per_s"] = tokens / span if span > 0 else None
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
