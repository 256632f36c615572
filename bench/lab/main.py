"""The run behind ``inferlb bench lab``: plan -> runs -> JSON, plots and BENCHMARKS.md's lab section."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

from bench.lab import plots, report
from bench.lab.cluster import SlowLoopTiming
from bench.lab.runner import Point, lab_document, plan, run_points
from bench.markdown import replace_marked
from bench.quality.report import git_commit, utc_now

__all__ = ["run_lab"]


def run_lab(*, scenarios: list[str], policies: list[str], quick: bool, engines: int | None, seed: int,
            json_path: str | None, markdown_path: str | None, plots_dir: str | None, slo_ttft_p90_ms: float,
            jobs: int, duration_s: float | None = None, timing: SlowLoopTiming | None = None) -> dict:
    """Run the lab and write its outputs (``markdown_path`` / ``plots_dir`` None: not written); returns
    the JSON document of this run. The plots, ``plots_dir``'s ``results.json`` and the markdown show
    the stored results with this run's rows in place of theirs (:func:`bench.lab.report.merge_results`),
    so a run of some scenarios or policies updates the page without dropping the rest."""
    points = plan(scenarios, policies, quick, engines, seed, timing, duration_s)
    command = "inferlb " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else \
        "inferlb bench lab" + (" --quick" if quick else "") + "".join(f" --scenario {s}" for s in scenarios)
    started = time.monotonic()
    total = len(points)
    finished: dict[int, dict] = {}  # point index -> figures
    left = Counter(p.scenario for p in points)  # runs not finished yet, per scenario

    def write() -> dict:
        """Write the scenarios whose runs have all finished."""
        ready = [i for i in range(total) if not left[points[i].scenario]]
        doc = lab_document([points[i] for i in ready], [finished[i] for i in ready], seed=seed, commit=commit,
                           command=command, date=utc_now(), slo_ttft_p90_ms=slo_ttft_p90_ms)
        doc["wall_s"] = round(time.monotonic() - started, 1)
        doc["cpu_s"] = round(sum(finished[i].get("cpu_s", 0.0) for i in ready), 1)
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(doc, indent=1) + "\n")
        page = doc
        if plots_dir:
            store = Path(plots_dir) / "results.json"
            page = report.merge_results(json.loads(store.read_text()) if store.exists() else None, doc)
            for name in doc["scenarios"]:
                plots.sweep_plots(name, page["scenarios"][name], Path(plots_dir), slo_ttft_p90_ms)
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(page, indent=1) + "\n")
        if markdown_path:
            md = Path(markdown_path)
            rel = os.path.relpath(plots_dir or ".", md.resolve().parent)
            replace_marked(md, report.BEGIN, report.END, report.lab_section(page, rel),
                           "## Decision quality at field scale: the policy lab")
        return doc

    def done(i: int, p: Point, figures: dict) -> None:
        finished[i] = figures
        left[p.scenario] -= 1
        n = len(finished)
        print(f"[{n}/{total}] {p.scenario} {p.policy} {p.qps:g} QPS: TTFT p90 {figures['ttft_p90_ms']} ms, "
              f"{figures['output_tokens_per_s']} tok/s, cpu {figures['cpu_s']:.1f} s "
              f"({time.monotonic() - started:.0f} s so far)", file=sys.stderr, flush=True)
        if not left[p.scenario] and n < total:  # a scenario is complete: its results are written at once
            write()

    commit = git_commit(Path.cwd())
    print(f"inferlb bench lab: {total} runs ({len(scenarios)} scenarios x {len(policies)} policies x points)"
          f"{' (quick)' if quick else ''}, {jobs} job(s)", file=sys.stderr, flush=True)
    run_points(points, jobs, done)
    doc = write()
    print(f"inferlb bench lab: done in {doc['wall_s']:.0f} s, {doc['cpu_s']:.0f} s of CPU in the runs; CPU (s) by "
          "scenario and policy:", file=sys.stderr, flush=True)
    for name, sc in doc["scenarios"].items():
        print(f"  {name}: " + ", ".join(f"{pol} {row['cpu_s']:g}" for pol, row in sc["policies"].items()),
              file=sys.stderr, flush=True)
    return doc
