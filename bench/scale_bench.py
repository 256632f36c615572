"""Scale benchmark: one weight round of the control plane at 1 000 .. 60 000 endpoints in one cluster.

For each size, in a fresh child process (so memory is its own), the real wiring of ``inferlb serve``
(:class:`inferlb.serve.InferLB`: control plane, snapshot cache, the picker's endpoint view, the
history recorder) runs weight rounds fed by a stand-in metrics source that answers every endpoint
with full statistics (latency, queue, GPU, KV cache, request rate...), new values every round, so
every weight is recomputed (the rings are rebuilt only in the first round: the endpoints stay). Measured
per size:

- **round CPU**: process CPU time (all threads) of one steady round (``ControlPlane.run_round``:
  engine, snapshot build, cache, picker view, history rows written), median of the rounds after the first;
  and, alone (the cyclic GC off, as in a round), the engine (``compute_weights``), the snapshot build,
  the picker's view build, and writing one history row per endpoint;
- **loop blocked**: the longest time the asyncio event loop (the one the ADS server, the picker and
  the admin API share) did not run a 5 ms timer during the steady rounds, and during the first
  round (which builds the picker's rings from scratch);
- **RSS** of the process after a steady round (its history rows written; the largest of the steady
  rounds, MB) and its **peak RSS** over the whole run (``ru_maxrss``: mid-round, two rounds' objects are
  alive).

The history is an SQLite file in a temporary folder (as ``inferlb serve`` writes one). The history
writes a row for each endpoint whose weight or health changed: with these answers 34 949 of 60 000
weights change every steady round (58 %; the engine alone on the same answers), so a round writes
that many rows; a round counts until its rows are written.

Not included: Prometheus itself and the wire (the ADS push to many streams is ``bench.xds_bench``).

Run from the repository root: ``python3 -m bench.scale_bench [--sizes 1000,...] [--write]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.markdown import write_run_section

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 60_000)
ROUNDS = 4
TARGETS = {"round_cpu_s_at_60k": 1.0, "loop_blocked_ms": 50.0, "rss_mb_at_60k": 500.0}


def fleet(n: int, history_path: str = ":memory:") -> dict:
    """One service, one version, ``n`` endpoints (``10.a.b.c:8000``); the history at ``history_path``."""
    eps = [{"address": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000", "max_concurrency": 16}
           for i in range(n)]
    return {"listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "history": {"path": history_path},
            "services": [{"name": "chat", "versions": [{"name": "v1", "endpoints": eps}]}]}


def stats_sets(instances: list[str], rounds: int, seed: int = 15) -> list[dict]:
    """``rounds`` answers of a metrics source: every input of every endpoint, new values each round."""
    from xds_server.metrics.stats import EndpointStats

    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        out.append({i: EndpointStats(
            latency_mean_ms=rng.uniform(50, 200), latency_p95_ms=rng.uniform(100, 400), queue=rng.uniform(0, 3),
            running=rng.uniform(0, 12), in_flight=rng.uniform(0, 15), gpu_util=rng.random(),
            gpu_mem_free_mib=rng.uniform(10_000, 60_000), gpu_mem_used_mib=rng.uniform(10_000, 60_000),
            kv_cache=rng.random(), request_rate=rng.uniform(0, 5), error_rate=rng.uniform(0, 0.01),
            success_total=rng.uniform(1e3, 1e4), oom_total=0.0, sample_age_s=rng.uniform(0, 2)) for i in instances})
    return out


class Source:
    """A pull source answering the prebuilt stats, one set per round, in turn."""

    name = "bench"

    def __init__(self, sets: list[dict]) -> None:
        self.sets, self.i = sets, 0

    def fetch(self, instances):
        out = self.sets[self.i % len(self.sets)]
        self.i += 1
        return out


async def _measure(n: int, history_path: str) -> dict:
    import psutil

    from inferlb.serve import InferLB
    from xds_server.config import Config
    from xds_server.control import endpoint_specs
    from xds_server.engine.builtin import BUILTIN
    from xds_server.engine.pipeline import compute_weights
    from xds_server.history.changes import to_record
    from xds_server.history.sqlite import open_store
    from xds_server.metrics.combined import CombinedSource
    from xds_server.resources.build import build_snapshot

    proc = psutil.Process()
    cfg = Config.model_validate(fleet(n, history_path))
    app = InferLB(cfg)
    instances = [s.instance for s in endpoint_specs(cfg)]
    # Two answers, alternating: every round still brings new values for every endpoint, and the
    # stand-in holds 2 rounds of stats, not ROUNDS (each set is ~36 MB of RSS at 60 000 endpoints).
    sets = stats_sets(instances, 2)
    app.control.source = CombinedSource([Source(sets)])
    app.recorder.start()  # as in InferLB.start: the history writer thread takes each round's weights
    lag = {"max": 0.0}
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lag["max"] = max(lag["max"], time.perf_counter() - t - 0.005)

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    rounds, lags, rss = [], [], []  # RSS (MB) after each round's history rows are written
    for _ in range(ROUNDS):
        before = cpu()
        lag["max"] = 0.0
        ok = await app.control.run_round()
        await asyncio.to_thread(app.recorder.flush, 60.0)  # its history rows are written: part of the round
        rounds.append(cpu() - before)
        lags.append(lag["max"])
        rss.append(proc.memory_info().rss / 2**20)
        assert ok and len(app.control.weights) == n
    stop.set()
    await task
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    # The stages alone, on the same inputs (single-threaded, so process_time is theirs), with the cyclic
    # GC off as in a round of `inferlb serve` (InferLB._round_heap): a collection inside one stage
    # would be charged to it alone.
    gc.disable()
    specs, params = endpoint_specs(cfg), app.control._params
    state = app.control._state
    t = time.process_time()
    weights, _ = compute_weights(specs, sets[0], state, params, now=1e6, plugins=BUILTIN)
    engine = time.process_time() - t
    t = time.process_time()
    # With the rounds' memo, as a steady round builds (the endpoints' encodings cached, new weights).
    snap = build_snapshot(cfg, weights, "127.0.0.1:18080", app.control._memo)
    build = time.process_time() - t
    t = time.process_time()
    app.view.update(snap.assignments(), app.routing)
    view = time.process_time() - t
    app.recorder.close()
    t = time.process_time()  # every endpoint changed: one history row each, as in every measured round
    rows, _ = to_record(weights, {}, 1e6, snap.version, cfg.history.keyframe_s)
    store = open_store(cfg.history)
    store.append(rows)
    history = time.process_time() - t
    store.close()
    gc.enable()
    steady = rounds[1:]
    return {"endpoints": n, "round_cpu_s": round(statistics.median(steady), 3),
            "round_cpu_range_s": [round(min(steady), 3), round(max(steady), 3)],
            "first_round_cpu_s": round(rounds[0], 3), "engine_cpu_s": round(engine, 3),
            "build_cpu_s": round(build, 3), "view_cpu_s": round(view, 3), "history_cpu_s": round(history, 3),
            "loop_blocked_ms": round(max(lags[1:]) * 1000, 1),
            "first_round_loop_blocked_ms": round(lags[0] * 1000, 1), "rss_mb": round(max(rss[1:]), 1),
            "peak_rss_mb": round(peak, 1)}


def run_size(n: int) -> dict:
    """One size in a fresh child process."""
    out = subprocess.run([sys.executable, "-m", "bench.scale_bench", "--child", str(n)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"size {n} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: list[dict]) -> str:
    base = results[0]
    lines = ["| endpoints | round CPU (s), median (min–max) | per 1k endpoints (s) | engine (s) | snapshot build (s) "
             "| picker view (s) | history rows (s) | loop blocked, max (ms) | first round CPU (s) "
             "| first round: loop blocked (ms) | RSS (MB) | peak RSS (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lo, hi = r["round_cpu_range_s"]
        lines.append(f"| {r['endpoints']:,} | {r['round_cpu_s']} ({lo}–{hi}) "
                     f"| {r['round_cpu_s'] / r['endpoints'] * 1000:.3f} | {r['engine_cpu_s']} | {r['build_cpu_s']} "
                     f"| {r['view_cpu_s']} | {r['history_cpu_s']} | {r['loop_blocked_ms']} | {r['first_round_cpu_s']} "
                     f"| {r['first_round_loop_blocked_ms']} | {r['rss_mb']} | {r['peak_rss_mb']} |")
    last = results[-1]
    lines.append("")
    lines.append(f"Linearity: CPU per 1 000 endpoints {base['round_cpu_s'] / base['endpoints'] * 1000:.3f} s at "
                 f"{base['endpoints']:,}, {last['round_cpu_s'] / last['endpoints'] * 1000:.3f} s at "
                 f"{last['endpoints']:,}. Targets (issue 15): round ≤ {TARGETS['round_cpu_s_at_60k']:g} s CPU at "
                 f"60 000, loop blocked ≤ {TARGETS['loop_blocked_ms']:g} ms, RSS ≤ {TARGETS['rss_mb_at_60k']:g} MB.")
    return "\n".join(lines)


def write_benchmarks(table: str, command: str) -> None:
    from bench.xds_bench import machine

    write_run_section(ROOT / "BENCHMARKS.md", "scale_bench", "## Scale: one weight round at 1 000 .. 60 000 endpoints",
                      table, command, f"{machine()} (shared with other jobs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="endpoint counts, comma-separated")
    parser.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    args = parser.parse_args()
    if args.child:
        import logging

        logging.disable(logging.INFO)  # the first round logs every endpoint's new weight
        with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
            print(json.dumps(asyncio.run(_measure(args.child, str(Path(tmp) / "history.sqlite3")))), flush=True)
        return
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        results.append(run_size(n))
        print(json.dumps(results[-1]), flush=True)
    table = report(results)
    print(table)
    if args.write:
        write_benchmarks(table, "python3 -m bench.scale_bench --write")


if __name__ == "__main__":
    main()
