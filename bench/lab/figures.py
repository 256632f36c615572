"""The figures of one run (one policy at one QPS point) and of a sweep (pure).

Over the *measured* requests (arrived in ``[warmup_s, duration_s)``):

- TTFT = first token - arrival at the router (a policy's queue counts); a request that never got
  its first token counts as censored at the run's end (its TTFT is at least that), so an overloaded
  point's percentiles are lower bounds, never flattered by dropping the slowest;
- ITL = a request's mean time between output tokens, ``(end - first token) / (output - 1)``;
- end-to-end = end - arrival (answered requests);
- output tokens per s: the tokens generated during the measured window by every request, each
  request's tokens spread evenly between its first token and its end, over the window's length;
- prefix-cache hit rate: prompt tokens the engines found cached / prompt tokens, of the measured
  requests that ran;
- waiting: the engines' mean waiting queue at the slow loop's scrapes in the window; preemptions:
  the engines' count in the window;
- error rate: measured requests not answered 200 (rejections, engine failures, connect failures,
  a version other than the one asked for, no first token by the run's end); a request still
  decoding at the end is no error (its TTFT counts, its end-to-end time does not); OOM rate: engine
  out-of-memory failures;
- shares: each endpoint's share of the measured requests it served;
- sessions moved (runs with an ``add`` fault, else None): among sessions answered both before the
  first engine joined and between then and the next fault, the share whose last endpoint before
  differs from their last endpoint after: the KV caches a scale-up made cold (``inferlb bench
  quality``'s figure of the same name; consistent hashing moves about 1/N of them).

Percentiles are numpy's linear interpolation between closest ranks. Times in ms, rates 0-1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.lab.harness import Record, RunResult

__all__ = ["DEFAULT_SLO_TTFT_P90_MS", "MAX_ERROR_RATE", "max_qps_within_slo", "point_figures", "sessions_moved"]

#: The SLO of ``max_qps_within_slo``: TTFT p90 at most this (ms).
DEFAULT_SLO_TTFT_P90_MS = 2000.0
#: ... and at most this share of the measured requests failed.
MAX_ERROR_RATE = 0.01


def _pct(values: Sequence[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values), q)) * 1000.0, 3)


def _window_tokens(r: Record, start: float, end: float) -> float:
    if r.status != 200 or r.first_s is None or r.end_s is None:
        return 0.0
    span = r.end_s - r.first_s
    if span <= 0:
        return float(r.output_tokens) if start <= r.end_s < end else 0.0
    overlap = min(end, r.end_s) - max(start, r.first_s)
    return r.output_tokens * max(0.0, overlap) / span


def sessions_moved(result: RunResult) -> float | None:
    """See the module docstring (0-1; None: the run has no ``add`` fault or no session answered on both
    sides of it)."""
    adds = sorted(f.at_s for f in result.spec.faults if f.kind == "add")
    if not adds:
        return None
    at_s = adds[0]
    until_s = min((f.at_s for f in result.spec.faults if f.at_s > at_s), default=float("inf"))
    before: dict[int, str] = {}
    after: dict[int, str] = {}
    for r in sorted(result.records, key=lambda r: (r.arrival_s, r.id)):
        if r.session is None or r.status != 200 or r.endpoint is None:
            continue
        if r.arrival_s < at_s:
            before[r.session] = r.endpoint
        elif r.arrival_s < until_s:
            after[r.session] = r.endpoint
    both = [s for s in after if s in before]
    return round(sum(1 for s in both if before[s] != after[s]) / len(both), 4) if both else None


def point_figures(result: RunResult) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    spec = result.spec
    measured = [r for r in result.records if r.measured]
    n = len(measured)
    ttft = [(r.first_s if r.first_s is not None else result.ended_s) - r.arrival_s
            for r in measured if r.first_s is not None or r.status is None]
    ok = [r for r in measured if r.status == 200 and not r.wrong_version]
    itl = [(r.end_s - r.first_s) / (r.output_tokens - 1) for r in ok
           if r.output_tokens > 1 and r.first_s is not None and r.end_s is not None]
    e2e = [r.end_s - r.arrival_s for r in ok if r.end_s is not None]
    ran = [r for r in measured if r.first_s is not None]
    prompt = sum(r.prompt_tokens for r in ran)
    window = spec.duration_s - spec.warmup_s
    tokens = sum(_window_tokens(r, spec.warmup_s, spec.duration_s) for r in result.records)
    running = sum(1 for r in measured if r.status is None and r.first_s is not None)  # still decoding at the end
    errors = n - len(ok) - running
    served: dict[str, int] = {}
    for r in measured:
        if r.endpoint is not None and r.status == 200:
            served[r.endpoint] = served.get(r.endpoint, 0) + 1
    total_served = sum(served.values())
    reasons: dict[str, int] = {}
    for r in measured:
        if (r.status != 200 or r.wrong_version) and not (r.status is None and r.first_s is not None):
            why = "wrong-version" if r.wrong_version else (r.reason or str(r.status))
            reasons[why] = reasons.get(why, 0) + 1
    pre = sum(result.counters_end[a]["preemptions"] - result.counters_start.get(a, {}).get("preemptions", 0)
              for a in result.counters_end)
    return {
        "qps": spec.qps,
        "requests": n,
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p90_ms": _pct(ttft, 90), "ttft_p99_ms": _pct(ttft, 99),
        "ttft_mean_ms": None if not ttft else round(float(np.mean(ttft)) * 1000.0, 3),
        "itl_p50_ms": _pct(itl, 50), "itl_p90_ms": _pct(itl, 90),
        "e2e_p50_ms": _pct(e2e, 50), "e2e_p95_ms": _pct(e2e, 95),
        "output_tokens_per_s": round(tokens / window, 3) if window > 0 else None,
        "prefix_hit_rate": round(sum(r.cached_tokens for r in ran) / prompt, 4) if prompt else None,
        "waiting_mean": round(float(np.mean(result.waiting)), 3) if result.waiting else None,
        "preemptions": int(pre),
        "error_rate": round(errors / n, 4) if n else None,
        "oom_rate": round(sum(1 for r in measured if r.reason == "oom") / n, 4) if n else None,
        "errors": dict(sorted(reasons.items())),
        "censored": sum(1 for r in measured if r.first_s is None and r.status is None),
        "shares": {a: round(c / total_served, 4) for a, c in sorted(served.items())} if total_served else {},
        "sessions_moved": sessions_moved(result),
    }


def max_qps_within_slo(points: Sequence[Mapping[str, Any]], slo_ttft_p90_ms: float = DEFAULT_SLO_TTFT_P90_MS,
                       max_error_rate: float = MAX_ERROR_RATE) -> float | None:
    """The highest QPS at which the policy meets the SLO (TTFT p90 <= ``slo_ttft_p90_ms`` and an error
    rate <= ``max_error_rate``) at that point and at every lower one; None when it misses at the lowest.

    >>> max_qps_within_slo([{"qps": 1, "ttft_p90_ms": 10, "error_rate": 0}, {"qps": 2, "ttft_p90_ms": 3000,
    ...                     "error_rate": 0}, {"qps": 3, "ttft_p90_ms": 10, "error_rate": 0}])
    1
    """
    best = None
    for p in sorted(points, key=lambda p: p["qps"]):
        ttft, err = p.get("ttft_p90_ms"), p.get("error_rate")
        if ttft is None or ttft > slo_ttft_p90_ms or err is None or err > max_error_rate:
            break
        best = p["qps"]
    return best
