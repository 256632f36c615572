"""Sweeps: every policy at every QPS point of a scenario, one run each, and the lab's JSON document.

A point's run is a pure function of (scenario, policy, QPS, mode, engines, seed, timing): every
policy sees the same seeded arrivals at a point. Runs are independent, so ``jobs`` > 1 spreads them
over worker processes; the document does not depend on it. The runs start longest first (by their
offered requests, :func:`expected_requests`), so the workers finish together: the last to start are
the short ones.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.lab.cluster import SlowLoopTiming
from bench.lab.figures import DEFAULT_SLO_TTFT_P90_MS, max_qps_within_slo, point_figures
from bench.lab.harness import RunSpec, run
from bench.lab.policies import POLICIES
from bench.lab.scenarios import FULL, QUICK, SCENARIOS, LabScenario, Mode, quality_mirror, trace_scenario

__all__ = ["Point", "expected_requests", "lab_document", "plan", "run_point", "run_points", "scenario_for"]

#: The cyclic collector's young-generation threshold during a run (allocations net of frees; CPython's: 700).
RUN_GC_THRESHOLD = 100_000


@dataclass(frozen=True)
class Point:
    """One run of the lab: ``scenario`` (a name of :data:`SCENARIOS`, or ``trace:PATH`` /
    ``mooncake:PATH``), ``policy``, ``qps``, ``mode``, ``engines``, ``seed``, ``timing``."""

    scenario: str
    policy: str
    qps: float
    mode: Mode
    engines: int
    seed: int
    timing: SlowLoopTiming = SlowLoopTiming()


def scenario_for(name: str) -> LabScenario:
    """The scenario ``name`` (``trace:PATH`` and ``mooncake:PATH``: a replay of that file;
    ``quality:NAME``: :func:`~bench.lab.scenarios.quality_mirror`).

    Raises:
        KeyError: an unknown name.
    """
    kind, _, rest = name.partition(":")
    if rest and kind in ("trace", "mooncake"):
        return trace_scenario(kind, Path(rest))
    if rest and kind == "quality":
        return quality_mirror(rest)
    return SCENARIOS[name]


@contextmanager
def _collector_for_a_run() -> Iterator[None]:
    """The cyclic garbage collector, tuned for one run: what the process holds before it (the datasets,
    the last run's leftovers once collected) is frozen out of the collections, and the young generation
    is collected every :data:`RUN_GC_THRESHOLD` allocations instead of 700. A run keeps millions of
    containers alive for a while (token tuples, key lists, records) and makes few reference cycles:
    at CPython's threshold the collector walked them over and over, about a tenth of a run's CPU time."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(RUN_GC_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def run_point(point: Point) -> dict[str, Any]:
    """The figures of one run (:func:`bench.lab.figures.point_figures`) plus the CPU time it took
    (``cpu_s``, s of this process)."""
    sc = scenario_for(point.scenario)
    mode = point.mode
    spec = RunSpec(sc.cluster(point.engines), sc.workload(), point.qps, mode.duration_s, mode.warmup_s,
                   mode.drain_s, point.seed, point.timing, sc.gateways, sc.faults(mode.duration_s, point.engines))
    started = time.process_time()
    with _collector_for_a_run():
        figures = point_figures(run(spec, POLICIES[point.policy]))
    figures["cpu_s"] = round(time.process_time() - started, 3)
    return figures


def expected_requests(point: Point) -> float:
    """The requests a run is offered (QPS x the arrivals' span): what its CPU time grows with, the
    order :func:`run_points` starts the runs in."""
    return point.qps * point.mode.duration_s


def run_points(points: Sequence[Point], jobs: int = 1,
               done: Callable[[int, Point, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every point's figures, in ``points`` order. The runs start longest first
    (:func:`expected_requests`; ties in ``points`` order) on ``jobs`` worker processes; ``done(index,
    point, figures)`` is called as each finishes."""
    order = sorted(range(len(points)), key=lambda i: -expected_requests(points[i]))
    results: list[dict[str, Any]] = [{}] * len(points)
    if jobs <= 1:
        for i in order:
            results[i] = run_point(points[i])
            if done is not None:
                done(i, points[i], results[i])
        return results
    pool = ProcessPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(run_point, points[i]): i for i in order}
        for f in as_completed(futures):
            i = futures[f]
            results[i] = f.result()
            if done is not None:
                done(i, points[i], results[i])
        return results
    finally:  # on an error, the runs not started yet are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)


def plan(scenarios: Sequence[str], policies: Sequence[str], quick: bool, engines: int | None, seed: int,
         timing: SlowLoopTiming | None = None, duration_s: float | None = None) -> list[Point]:
    """The runs of a lab: every scenario x policy x QPS point (``engines`` None: the scenario's full
    size, :attr:`~bench.lab.scenarios.LabScenario.full_engines`, or with ``quick`` its
    :attr:`~bench.lab.scenarios.LabScenario.quick_engines`, else the mode's;
    ``duration_s``: the arrivals' span instead of the mode's, warm-up and drain kept in proportion, as
    a scenario's :attr:`~bench.lab.scenarios.LabScenario.full_duration_s` sets them in the full lab and its
    :attr:`~bench.lab.scenarios.LabScenario.quick_duration_s` with ``--quick``; a
    scenario with a size and length of its own keeps them)."""
    mode = QUICK if quick else FULL
    timing = timing or SlowLoopTiming()
    out = []
    for s in scenarios:
        sc = scenario_for(s)
        n = sc.engines or engines or (sc.quick_engines if quick else sc.full_engines) or mode.engines
        span = duration_s or (sc.quick_duration_s if quick else sc.full_duration_s)
        m = sc.mode or (_stretched(mode, span) if span is not None else mode)
        out += [Point(s, p, q, m, n, seed, sc.timing or timing) for q in sc.points(quick, n) for p in policies]
    return out


def _stretched(mode: Mode, duration_s: float) -> Mode:
    """``mode`` with ``duration_s`` of arrivals, its warm-up and drain in proportion."""
    k = duration_s / mode.duration_s
    return replace(mode, duration_s=duration_s, warmup_s=mode.warmup_s * k, drain_s=mode.drain_s * k)


def lab_document(points: Sequence[Point], results: Sequence[Mapping[str, Any]], *, seed: int, commit: str | None,
                 command: str, date: str, slo_ttft_p90_ms: float = DEFAULT_SLO_TTFT_P90_MS) -> dict[str, Any]:
    """The lab's JSON: ``{"scenarios": {NAME: {"policies": {POLICY: {"points": [...], "max_qps_within_slo":
    .., "cpu_s": ..}}, ...}}, "seed", "commit", "command", "date", "slo_ttft_p90_ms"}`` (points in QPS
    order; a policy's ``cpu_s``: its points' CPU time summed, s)."""
    scenarios: dict[str, Any] = {}
    for p, figures in zip(points, results, strict=True):
        sc = scenarios.setdefault(p.scenario, {
            "title": scenario_for(p.scenario).title, "engines": p.engines, "duration_s": p.mode.duration_s,
            "warmup_s": p.mode.warmup_s, "policies": {}})
        sc["policies"].setdefault(p.policy, {"points": []})["points"].append(dict(figures))
    for sc in scenarios.values():
        for pol in sc["policies"].values():
            pol["points"].sort(key=lambda f: f["qps"])
            pol["max_qps_within_slo"] = max_qps_within_slo(pol["points"], slo_ttft_p90_ms)
            pol["cpu_s"] = round(sum(f.get("cpu_s", 0.0) for f in pol["points"]), 1)
    return {"scenarios": scenarios, "seed": seed, "commit": commit, "command": command, "date": date,
            "slo_ttft_p90_ms": slo_ttft_p90_ms, "cpus": os.cpu_count()}
