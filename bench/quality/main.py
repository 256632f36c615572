"""The run behind ``inferlb bench quality``: scenarios -> store, BENCHMARKS.md section, plots, JSON."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path

from bench.progress import Progress
from bench.quality import plots, report
from bench.quality.policies import policies_for
from bench.quality.runner import ScenarioRunner
from bench.quality.scenarios import SCENARIOS
from inferlb.devstack import stack

log = logging.getLogger(__name__)


def run_quality(*, scenarios: list[str], quick: bool, json_path: str | None, markdown_path: str, plots_dir: str,
                seed: int, workdir: str | None, rounds: int | None = None) -> int:
    """Run ``scenarios`` (all policies each, interleaved in ``rounds`` rounds: default 1 quick, 2 full)
    and write the outputs; returns the exit code (0 = done, 1 = a process of the stack failed,
    2 = Prometheus is not installed)."""
    rounds = rounds or (1 if quick else 2)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(message)s")
    if stack.prometheus_binary() is None:
        print(f"inferlb bench quality: {stack.PROMETHEUS_INSTALL_HINT}", file=sys.stderr)
        return 2
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="inferlb-bench-quality-"))
    plots_path = Path(plots_dir)
    plots_path.mkdir(parents=True, exist_ok=True)
    md = Path(markdown_path)
    store_path = plots_path / "results.json"
    store = report.load_store(store_path)
    command = "inferlb " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else \
        "inferlb bench quality" + "".join(f" --scenario {s}" for s in scenarios) + (" --quick" if quick else "") \
        + f" --rounds {rounds}"
    host, envoy = report.machine(), stack.envoy_version()
    commit = report.git_commit(Path.cwd())
    runs = sum(len(policies_for(SCENARIOS[name])) for name in scenarios)
    print(f"inferlb bench quality: {len(scenarios)} scenario(s), {runs} policy runs x {rounds} round(s)"
          f"{' (quick)' if quick else ''}; work dir {work}", file=sys.stderr, flush=True)
    planned = sum(sum(SCENARIOS[name].durations(quick)) for name in scenarios) / max(1, len(scenarios))
    with Progress(runs * rounds, planned, "bench quality") as progress:
        for name in scenarios:
            try:
                run = ScenarioRunner(SCENARIOS[name], quick=quick, seed=seed, workdir=work).run(
                    list(policies_for(SCENARIOS[name])), rounds, progress)
            except stack.StackError as err:
                print(f"inferlb bench quality: {name}: {err}", file=sys.stderr)
                return 1
            figures, meta = report.record(run, command=command, host=host, date=report.utc_now(), commit=commit,
                                          envoy=envoy)
            store = report.merge(store, name, figures, meta)
            plots.latency_cdf(run, plots_path / f"{name}-latency.png")
            plots.ttft_cdf(run, plots_path / f"{name}-ttft.png")
            plots.weights_over_time(run, plots_path / f"{name}-weights.png")
            store_path.write_text(json.dumps(store, indent=1) + "\n")
            report.write_section(md, report.render_section(store, os.path.relpath(plots_path, md.resolve().parent)))
            print(f"inferlb bench quality: {name} done in {run.wall_s:.0f} s", file=sys.stderr, flush=True)
    assert store is not None
    if json_path:
        Path(json_path).write_text(json.dumps(report.json_document(store, scenarios), indent=1) + "\n")
    print(f"inferlb bench quality: wrote {md}, {plots_path}/" + (f", {json_path}" if json_path else ""),
          file=sys.stderr)
    return 0
