"""``inferlb bench lab``: routing policies on simulated engines in virtual time (see :mod:`bench.lab`).

Only click is imported at module level, so registering the command costs the ``inferlb`` CLI nothing.
"""

from __future__ import annotations

import click

#: The lab's scenarios and policies, by name (plain tuples: the modules behind them load on use).
SCENARIO_NAMES = ("shared_prefix", "sharegpt_chat", "uniform", "long_tail", "heterogeneous", "versions", "scaling",
                  "uneven", "multi_gateway", "edge_cloud", "sessions")
POLICY_NAMES = ("round_robin", "least_request", "ring_hash_bounded", "random", "llm_d", "sglang_cache_aware",
                "dynamo_kv", "oracle", "inferlb", "inferlb_precise", "inferlb_latency")
#: The policies a run without ``--policy`` compares: all but ``inferlb_precise``, inferlb's picker on the engines'
#: KV events, which a deployment has only where its engines publish them, and ``inferlb_latency``, the
#: ``predicted-latency`` picker, a named profile and not the default (run them with ``--policy``; their rows
#: join the stored results beside the others).
DEFAULT_POLICY_NAMES = tuple(p for p in POLICY_NAMES if p not in ("inferlb_precise", "inferlb_latency"))


@click.command("lab")
@click.option("--scenario", "scenarios", multiple=True, type=click.Choice(SCENARIO_NAMES),
              help="Run only this scenario (repeatable). Default: all.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(POLICY_NAMES),
              help="Run only this policy (repeatable). Default: all but inferlb_precise and inferlb_latency.")
@click.option("--trace", "traces", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Also replay this JSONL request trace (format: docs/benchmarks.md; repeatable).")
@click.option("--mooncake", "mooncakes", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Also replay this Mooncake block-hash trace (timestamp ms, input_length, output_length, "
                   "hash_ids; repeatable).")
@click.option("--quality", "qualities", multiple=True,
              help="Also run inferlb bench quality's scenario NAME in the lab, at its own size and rate in engine "
                   "time (one yardstick, two paths; repeatable).")
@click.option("--quick", is_flag=True, help="4 engines, 60 virtual s per point, fewer points (CI).")
@click.option("--engines", type=click.IntRange(1, 256), default=None,
              help="Engines per cluster.  [default: 16, 4 with --quick]")
@click.option("--duration", "duration_s", type=click.FloatRange(min=1.0), default=None,
              help="Virtual seconds of arrivals per point.  [default: 600, 60 with --quick]")
@click.option("--seed", default=1, show_default=True, type=int, help="Seed of every random draw.")
@click.option("--slo-ttft-p90-ms", default=2000.0, show_default=True, type=click.FloatRange(min=1.0),
              help="The SLO of max_qps_within_slo: TTFT p90 at most this (ms).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Worker processes (the runs are independent; the JSON does not depend on it).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the figures here.")
@click.option("--markdown", "markdown_path", default=None, type=click.Path(dir_okay=False),
              help="Markdown file whose lab section is (re)written.  [default: BENCHMARKS.md, none with --quick]")
@click.option("--plots", "plots_dir", default=None, type=click.Path(file_okay=False),
              help="Where the PNGs and results.json go.  [default: docs/bench/lab, none with --quick]")
def lab(scenarios: tuple[str, ...], policies: tuple[str, ...], traces: tuple[str, ...], mooncakes: tuple[str, ...],
        qualities: tuple[str, ...], quick: bool, engines: int | None, duration_s: float | None, seed: int,
        slo_ttft_p90_ms: float, jobs: int, json_path: str | None, markdown_path: str | None,
        plots_dir: str | None) -> None:
    """Decision quality at field scale, in virtual time: every policy (Envoy's, llm-d's, SGLang's, Dynamo's,
    an oracle, inferlb's own code) on simulated LLM engines, per scenario a QPS sweep."""
    from bench.lab.main import run_lab

    names = list(scenarios) or ([] if traces or mooncakes or qualities else list(SCENARIO_NAMES))
    names += [f"trace:{t}" for t in traces] + [f"mooncake:{m}" for m in mooncakes] + [f"quality:{q}" for q in qualities]
    if not quick:
        markdown_path = markdown_path or "BENCHMARKS.md"
        plots_dir = plots_dir or "docs/bench/lab"
    run_lab(scenarios=names, policies=list(policies) or list(DEFAULT_POLICY_NAMES), quick=quick, engines=engines,
            seed=seed, json_path=json_path, markdown_path=markdown_path, plots_dir=plots_dir,
            slo_ttft_p90_ms=slo_ttft_p90_ms, jobs=jobs, duration_s=duration_s)
