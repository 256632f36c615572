"""``inferlb bench quality``: run the scenarios, write BENCHMARKS.md, the plots and (optionally) JSON.

Only click and the scenario table (plain data) are imported at module level, so registering the
command costs the ``inferlb`` CLI next to nothing.
"""

from __future__ import annotations

import click

from bench.quality.scenarios import SCENARIO_NAMES


@click.command("quality")
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice(SCENARIO_NAMES),
              help="Run only this scenario (repeatable). Default: all.")
@click.option("--quick", is_flag=True, help="Short runs (each scenario <= 40 s): a smoke test, not numbers.")
@click.option("--rounds", type=click.IntRange(1, 20), default=None,
              help="Rounds of interleaved runs (every policy once per round, order rotated).  [default: 1 with "
                   "--quick, else 2]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the figures here.")
@click.option("--markdown", "markdown_path", default="BENCHMARKS.md", show_default=True,
              type=click.Path(dir_okay=False), help="Markdown file whose quality section is (re)written.")
@click.option("--plots", "plots_dir", default="docs/bench/quality", show_default=True,
              type=click.Path(file_okay=False), help="Where the PNGs and the results store (results.json) go.")
@click.option("--seed", default=1, show_default=True, type=int, help="Seed of the traces and the backends.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep configs and logs here (default: a temp dir).")
def quality(scenarios: tuple[str, ...], quick: bool, rounds: int | None, json_path: str | None, markdown_path: str,
            plots_dir: str, seed: int, workdir: str | None) -> None:
    """Decision quality: every scenario against Envoy's round_robin, least_request, ring_hash,
    ring_hash with bounded loads and inferlb (EDS weights only, and full), on the same seeded
    streaming chat traffic, the policies interleaved in rounds."""
    from bench.quality.main import run_quality

    code = run_quality(scenarios=list(scenarios) or list(SCENARIO_NAMES), quick=quick, json_path=json_path,
                       markdown_path=markdown_path, plots_dir=plots_dir, seed=seed, workdir=workdir, rounds=rounds)
    raise SystemExit(code)
