"""``inferlb bench picker``: the picker's cost on real Envoy with wrk (only click imported at module level)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click


@click.command("picker")
@click.option("--json", "json_path", required=True, type=click.Path(), help="Write the result document here.")
@click.option("--duration", default=5, show_default=True, type=click.IntRange(1, 3600),
              help="Seconds per wrk run (whole seconds: wrk's -d).")
@click.option("--runs", default=3, show_default=True, type=int, help="Rounds (each variant once per round; medians).")
@click.option("--transport", type=click.Choice(["fast", "grpcio"]), default="fast", show_default=True)
@click.option("--workers", default=1, show_default=True, type=int, help="Picker processes.")
@click.option("--envoy-concurrency", default=1, show_default=True, type=int, help="Envoy worker threads.")
@click.option("--body-kb", default=0, show_default=True, type=click.IntRange(0, 512),
              help="POST a chat JSON body of this many KiB, read by the picker's default body routing "
                   "(0: GET, headers only).")
@click.option("--markdown", "md_path", type=click.Path(), help="Also write the section into this BENCHMARKS.md.")
@click.option("--before", type=click.Path(exists=True, file_okay=False),
              help="Also run the picker of this checkout (PYTHONPATH) in every round: before/after in one run.")
@click.option("--profile", "profile_s", default=0, show_default=True, type=click.IntRange(0, 600),
              help="Then profile the picker with py-spy for this many seconds under wrk (0: no profile).")
def picker(json_path: str, duration: int, runs: int, transport: str, workers: int, envoy_concurrency: int,
           body_kb: int, md_path: str | None, before: str | None, profile_s: int) -> None:
    """The picker's cost on real Envoy with wrk, against no ext_proc and a null ext_proc server:
    req/s, ratio to null, Python and Envoy CPU per request, added latency."""
    from bench.picker import markdown, run, write_markdown

    logging.getLogger().setLevel(logging.WARNING)
    doc = run(duration_s=duration, runs=runs, transport=transport, workers=workers,
              envoy_concurrency=envoy_concurrency, body_kb=body_kb, before=Path(before) if before else None,
              profile_s=profile_s)
    command = "inferlb bench picker " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "inferlb bench picker"
    doc["command"] = command
    Path(json_path).write_text(json.dumps(doc, indent=2))
    section = markdown(doc, command)
    if md_path:
        key = f"picker-{transport}-w{workers}-c{envoy_concurrency}" + (f"-b{body_kb}" if body_kb else "")
        write_markdown(Path(md_path), section, key)
    click.echo(section)


@click.command("ext-proc-config")
@click.option("--json", "json_path", required=True, type=click.Path(), help="Write the result document here.")
@click.option("--duration", default=3, show_default=True, type=click.IntRange(1, 3600),
              help="Seconds per wrk run (whole seconds: wrk's -d).")
@click.option("--runs", default=5, show_default=True, type=int, help="Rounds (each variant once per round).")
@click.option("--body-kb", default=0, show_default=True, type=click.IntRange(0, 512),
              help="POST a JSON body of this many KiB and run the body-mode variants instead.")
@click.option("--connections", default=16, show_default=True, type=int, help="wrk connections.")
@click.option("--only", multiple=True, help="Run only these variants (and `none`); repeatable.")
@click.option("--markdown", "md_path", type=click.Path(), help="Also write the section into this BENCHMARKS.md.")
def ext_proc_config(json_path: str, duration: int, runs: int, body_kb: int, connections: int,
                    only: tuple[str, ...], md_path: str | None) -> None:
    """What each part of the picker's Envoy ext_proc config costs Envoy per request (null servers)."""
    from bench.ext_proc_config import markdown, run
    from bench.picker import write_markdown

    doc = run(duration_s=duration, runs=runs, connections=connections, body_kb=body_kb, only=list(only) or None)
    command = "inferlb bench ext-proc-config " + " ".join(sys.argv[3:])
    doc["command"] = command
    Path(json_path).write_text(json.dumps(doc, indent=2))
    section = markdown(doc, command.strip())
    if md_path:
        key = "ext-proc-config" + (f"-b{body_kb}" if body_kb else "")
        key += f"-n{connections}" if connections != 16 else ""
        write_markdown(Path(md_path), section, key)
    click.echo(section)
