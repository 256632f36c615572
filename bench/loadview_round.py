"""Load-view benchmark: one memory round sent to every picker's stream, at 10 000 and 60 000 endpoints.

The control plane's load-view service (:class:`xds_server.loadview.service.LoadViewServicer`, called
in process, its views read as they are yielded: no gRPC wire) holds the reports of 3 pickers, each
reporting every 10 ms with ``--load`` endpoints with memory in flight (2 GiB each) and 20 requests
finished per report; then a round of memory samples (one per endpoint, 0.2-1 s old) arrives and
every stream sends it. Measured per size, each size in a fresh child process, ``--rounds`` times in
turn:

- **loop blocked**: the longest time the event loop (the one the ADS server shares) did not run a
  2 ms timer, from the samples' arrival until every picker has its view of the round;
- **round wall time** until then, and the process's **CPU** over it (all threads).

Against the target of issue 15: no await point blocked longer than 50 ms.

Run from the repository root: ``python3 -m bench.loadview_round [--history-s 1,10] [--write]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.markdown import write_run_section

ROOT = Path(__file__).resolve().parent.parent
SIZES = (10_000, 60_000)
PICKERS = 3
REPORT_S = 0.01
FINISHED_PER_REPORT = 20
TARGET_LOOP_BLOCKED_MS = 50.0


class _Context:
    """The servicer's view of a gRPC call: only the peer's name is read (when a report is refused)."""

    def peer(self) -> str:
        return "bench"


async def measure(n: int, load: int, history_s: float, seed: int = 4) -> dict:
    """One round at ``n`` endpoints after ``history_s`` of reports with ``load`` endpoints each:
    ``{"loop_blocked_ms", "round_s", "cpu_s", "samples"}``."""
    from protos import load_view_pb2
    from xds_server.loadview.service import LoadViewServicer
    from xds_server.loadview.table import Load, LoadTable, Report

    rng = random.Random(seed)
    endpoints = [f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000" for i in range(n)]
    table = LoadTable(expiry_s=1000.0)
    steps = round(history_s / REPORT_S)
    start = time.monotonic() - steps * REPORT_S
    for step in range(steps):
        for p in range(PICKERS):
            table.record(Report(
                f"picker-{p}", seq=step,
                endpoints={("chat", e): Load(1, 1, 2048.0, 100, 0) for e in rng.sample(endpoints, load)},
                finished=tuple((rng.choice(endpoints), rng.uniform(0, 2), 2048.0) for _ in range(FINISHED_PER_REPORT))),
                start + step * REPORT_S)
    servicer = LoadViewServicer(table)
    got: dict[int, int] = {}
    everyone = asyncio.Event()

    async def reports(p: int):
        yield load_view_pb2.LoadReport(picker=f"picker-{p}", seq=steps + 1)
        await asyncio.Event().wait()

    async def stream(p: int) -> None:
        async for view in servicer.Share(reports(p), _Context()):
            if view.memory_round:
                got[p] = len(view.memory)
                if len(got) == PICKERS:
                    everyone.set()

    streams = [asyncio.create_task(stream(p)) for p in range(PICKERS)]
    await asyncio.sleep(0.2)
    now = time.monotonic()
    samples = {e: (rng.uniform(0.0, 40960.0), now - rng.uniform(0.2, 1.0)) for e in endpoints}
    blocked = [0.0]

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            blocked[0] = max(blocked[0], time.perf_counter() - t - 0.002)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    blocked[0] = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    table.set_memory(samples)
    servicer._wake_all()  # as a report arriving would
    await everyone.wait()
    result = {"loop_blocked_ms": round(blocked[0] * 1000, 1), "round_s": round(time.perf_counter() - wall, 3),
              "cpu_s": round(time.process_time() - cpu, 3), "samples": min(got.values())}
    for task in [*streams, prober]:
        task.cancel()
    return result


def run(n: int, load: int, history_s: float) -> dict:
    """:func:`measure` in a fresh child process (its memory and threads its own)."""
    out = subprocess.run([sys.executable, "-m", "bench.loadview_round", "--child", str(n), "--load", str(load),
                          "--history-s", str(history_s)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{n} endpoints failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):g} ({min(values):g}–{max(values):g})"


def report(rows: list[tuple[int, float, list[dict]]], load: int) -> str:
    """The Markdown table: per size and history, medians (min–max) over the rounds."""
    lines = ["| endpoints | reports kept (s) | loop blocked, max (ms) | every view out (s) | CPU (s) | runs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for n, history_s, runs in rows:
        blocked, wall, cpu = ([r[k] for r in runs] for k in ("loop_blocked_ms", "round_s", "cpu_s"))
        lines.append(f"| {n:,} | {history_s:g} | {_spread(blocked)} | {_spread(wall)} | {_spread(cpu)} | {len(runs)} |")
    lines.append("")
    lines.append(f"{PICKERS} pickers, each report {load:,} endpoints with memory in flight and "
                 f"{FINISHED_PER_REPORT} finished, every {REPORT_S * 1000:g} ms. Target (issue 15): no loop block "
                 f"over {TARGET_LOOP_BLOCKED_MS:g} ms.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="endpoint counts, comma-separated")
    parser.add_argument("--load", type=int, default=500, help="endpoints with memory in each report")
    parser.add_argument("--history-s", default="1,10", help="seconds of reports kept before the round, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each case, interleaved")
    parser.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.child, args.load, float(args.history_s)))), flush=True)
        return
    cases = [(int(n), float(h)) for n in args.sizes.split(",") for h in args.history_s.split(",")]
    runs: dict[tuple[int, float], list[dict]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for n, history_s in cases:
            runs[(n, history_s)].append(run(n, args.load, history_s))
            print(json.dumps({"endpoints": n, "history_s": history_s, **runs[(n, history_s)][-1]}), flush=True)
    table = report([(n, h, runs[(n, h)]) for n, h in cases], args.load)
    print(table)
    if args.write:
        from bench.xds_bench import machine

        write_run_section(ROOT / "BENCHMARKS.md", "loadview_round",
                          "## Load view: one memory round to every picker at 10 000 and 60 000 endpoints", table,
                          "python3 -m bench.loadview_round --write", f"{machine()} (shared with other jobs)")


if __name__ == "__main__":
    main()
