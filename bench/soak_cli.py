"""``inferlb bench soak``: the demo stack for a long time under steady traffic and scheduled faults
(only click imported at module level)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click


@click.command("soak")
@click.option("--duration", default=3600.0, show_default=True, type=click.FloatRange(min=60),
              help="Seconds of traffic.")
@click.option("--warmup", default=120.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds before growth is measured (also after each restart, for the restarted process).")
@click.option("--fault-every", default=600.0, show_default=True, type=click.FloatRange(min=20),
              help="Seconds between faults (backend restart, Prometheus pause, picker restart, in turn).")
@click.option("--rate", default=10.0, show_default=True, type=click.FloatRange(min=0.1), help="Requests per second.")
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(1, 512),
              help="At most this many requests in flight.")
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False), help="Write the result here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Also write the section into this file.")
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep configs and logs here (default: a temp dir).")
def soak(duration: float, warmup: float, fault_every: float, rate: float, concurrency: int, json_path: str,
         md_path: str | None, workdir: str | None) -> None:
    """Drive the demo stack at a steady rate with faults on a schedule; report memory and open-file
    growth per process, failures by cause and the picker's in-flight drift. Exit 1 when a target
    is missed, 2 when the stack cannot start. Binds the demo's fixed ports: run it in its own
    network namespace (`unshare -n`)."""
    from bench.soak import markdown, run_soak, write_markdown
    from inferlb.devstack.stack import StackError

    logging.getLogger().setLevel(logging.WARNING)
    command = " ".join(["inferlb bench soak", *sys.argv[3:]])
    try:
        doc = run_soak(duration_s=duration, warmup_s=warmup, fault_every_s=fault_every, rate=rate,
                       concurrency=concurrency, workdir=workdir, command=command)
    except StackError as err:
        click.echo(f"inferlb bench soak: {err}", err=True)
        sys.exit(2)
    Path(json_path).write_text(json.dumps(doc, indent=2))
    if md_path:
        write_markdown(Path(md_path), doc)
    click.echo(markdown(doc))
    sys.exit(0 if doc["ok"] else 1)
