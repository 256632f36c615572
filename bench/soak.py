"""``inferlb bench soak``: the demo stack under steady traffic for a long time, with faults on a schedule.

The stack is the one ``inferlb demo`` starts (:func:`inferlb.demo.start_stack`: simulated backends,
Prometheus, ``inferlb serve`` with the picker in-process, Envoy; plain processes on fixed ports,
so run it in its own network namespace). Traffic is the demo's (:func:`inferlb.devstack.loadgen.drive`,
the ``openai`` client, mixed sessions and versions, 80 % streamed) held at a steady ``rate``.

Faults, in turn, every ``fault_every_s`` after the warm-up (the first half an interval in):

- ``backend-restart``: one simulated backend (each in turn) is SIGKILLed, stays down
  :data:`BACKEND_DOWN_S`, and is started again on its port;
- ``prometheus-pause``: Prometheus is SIGSTOPped for :data:`PROMETHEUS_PAUSE_S`, then SIGCONTed;
- ``picker-restart``: ``inferlb serve`` (the picker runs in it, as in the demo) gets SIGTERM and is
  started again; the fault ends when its ``/readyz`` answers.

A fault's documented window runs from its start to :data:`SETTLE_S` after its end; a request whose
life overlaps a window may fail (counted under that fault), any other failure (5xx or no answer)
counts against the target. When a fault ends, new requests are held back (those in flight finish)
and the picker's in-flight count (``inferlb_ext_proc_in_flight`` on the admin ``/metrics``) and the
backends' own running + waiting counts (``/sim/state``) are read every :data:`PROBE_EVERY_S` until
both are 0: the time that takes is the fault's drift settle time (target <= ``SETTLE_S``). The same
probe runs at the end of the warm-up and at the end of the run. Between probes the two counts are
sampled under traffic (their difference then includes requests in transit and Envoy's access-log
flush delay).

Every ``sample_every_s`` the resident memory (``VmRSS`` of ``/proc/PID/status``) and open files
(entries of ``/proc/PID/fd``) of each process are read. Growth is measured per process incarnation
(a restarted process starts a new one), from the median of its first three samples after its own
warm-up to the median of its last three. Targets: growth <= :data:`MEMORY_GROWTH_LIMIT_PCT` for every
process but Prometheus (whose head block grows with the samples it stores, by design; reported
only), no failure outside the windows, every settle time <= ``SETTLE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.markdown import replace_marked
from inferlb.devstack import stack
from inferlb.devstack.loadgen import DEMO_SYSTEM_PROMPT, Result, Traffic, drive, make_sessions

FAULTS = ("backend-restart", "prometheus-pause", "picker-restart")
#: Seconds after a fault ends that still belong to its window (failures allowed; drift must be 0 by then).
SETTLE_S = 10.0
BACKEND_DOWN_S = 2.0
PROMETHEUS_PAUSE_S = 15.0
PROBE_EVERY_S = 0.25
MEMORY_GROWTH_LIMIT_PCT = 5.0
#: Processes reported but not held to the memory target.
MEMORY_REPORT_ONLY = ("prometheus",)
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"


@dataclass
class Fault:
    """One injected fault: ``kind`` (one of :data:`FAULTS`), ``target`` (process name), ``start`` and
    ``end`` (s since the traffic started), and its drift probe: ``settle_s`` (s from ``end`` until
    the picker's and the backends' counts were both 0; None: not within the probe's limit) and the
    counts seen at the probe's last read (``picker_in_flight``, ``backends_running``). ``pids``: the
    target's process id before and after (a restart changes it)."""

    kind: str
    target: str
    start: float
    end: float = 0.0
    pids: tuple[int, int] = (0, 0)
    settle_s: float | None = None
    picker_in_flight: int | None = None
    backends_running: int | None = None


@dataclass
class Run:
    """What a soak run collected (times in s since the traffic started)."""

    faults: list[Fault] = field(default_factory=list)
    usage: list[dict] = field(default_factory=list)
    """``{"t", "process", "pid", "rss_mib", "fds"}`` per process per sample."""
    drift: list[dict] = field(default_factory=list)
    """``{"t", "picker", "backends", "client"}`` sampled under traffic (None: could not be read)."""
    probes: list[dict] = field(default_factory=list)
    """``{"at", "settle_s", "picker", "backends"}`` of the warm-up and final probes."""
    envoy: dict[str, int] = field(default_factory=dict)
    """Envoy's ext_proc and access-log counters at the end (Envoy is never restarted)."""


def fault_schedule(duration_s: float, warmup_s: float, fault_every_s: float) -> list[tuple[float, str]]:
    """``[(start s, kind)]``: faults in the order of :data:`FAULTS`, the first half an interval after the
    warm-up, then one every ``fault_every_s``, each starting at least ``SETTLE_S`` + 20 s before the end."""
    out: list[tuple[float, str]] = []
    t = warmup_s + fault_every_s / 2
    while t <= duration_s - SETTLE_S - 20:
        out.append((t, FAULTS[len(out) % len(FAULTS)]))
        t += fault_every_s
    return out


def proc_usage(pid: int) -> tuple[float, int] | None:
    """``(resident memory MiB, open file descriptors)`` of ``pid`` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_growth(usage: list[dict], warmup_s: float) -> dict[str, list[dict]]:
    """Per process name, one entry per incarnation (pid) with at least 4 samples after its warm-up
    (``warmup_s`` after its first sample): ``{"pid", "from_s", "to_s", "rss_mib": [first, last],
    "growth_pct", "fds": [first, last], "fd_growth"}`` (first/last: medians of three samples)."""
    by_pid: dict[tuple[str, int], list[dict]] = {}
    for u in usage:
        by_pid.setdefault((u["process"], u["pid"]), []).append(u)
    out: dict[str, list[dict]] = {}
    for (name, pid), rows in sorted(by_pid.items(), key=lambda kv: (kv[0][0], kv[1][0]["t"])):
        kept = [r for r in rows if r["t"] >= rows[0]["t"] + warmup_s]
        if len(kept) < 4:
            out.setdefault(name, [])
            continue
        rss0, rss1 = (statistics.median(r["rss_mib"] for r in part) for part in (kept[:3], kept[-3:]))
        fd0, fd1 = (statistics.median(r["fds"] for r in part) for part in (kept[:3], kept[-3:]))
        out.setdefault(name, []).append({
            "pid": pid, "from_s": round(kept[0]["t"], 1), "to_s": round(kept[-1]["t"], 1),
            "rss_mib": [round(rss0, 1), round(rss1, 1)], "growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
            "fds": [fd0, fd1], "fd_growth": fd1 - fd0})
    return out


def windows(faults: list[Fault]) -> list[tuple[float, float, str]]:
    """``[(from s, to s, kind)]``: each fault's documented window, start to end + ``SETTLE_S``."""
    return [(f.start, f.end + SETTLE_S, f.kind) for f in faults]


def cause(r: Result) -> str:
    """A failed request's cause: ``"STATUS ERROR"`` (e.g. ``"503 http_503"``, ``"0 connect"``)."""
    return f"{r.status} {r.error}"


def errors_by_cause(results: list[Result], spans: list[tuple[float, float, str]], t0: float) -> dict:
    """Failed requests by cause, ``{"outside": {cause: n}, "by_fault": {kind: {cause: n}}}``; a request
    counts under the first window its life (answer time - latency, answer time; ``t0`` = the wall
    clock of time 0) overlaps. 4xx are counted too; ``failed_outside`` = 5xx and no-answer outside."""
    outside: dict[str, int] = {}
    by_fault: dict[str, dict[str, int]] = {}
    failed_outside = 0
    for r in results:
        if 200 <= r.status < 300:
            continue
        end = r.at - t0
        begin = end - r.latency_ms / 1000
        kind = next((k for lo, hi, k in spans if begin <= hi and end >= lo), None)
        bucket = outside if kind is None else by_fault.setdefault(kind, {})
        bucket[cause(r)] = bucket.get(cause(r), 0) + 1
        if kind is None and (r.status == 0 or r.status >= 500):
            failed_outside += 1
    return {"outside": outside, "by_fault": by_fault, "failed_outside": failed_outside}


class Soak:
    """Runs one soak on a started :class:`inferlb.demo.DemoStack` (see the module docstring)."""

    def __init__(self, demo, *, duration_s: float, warmup_s: float, fault_every_s: float, rate: float,
                 concurrency: int, sample_every_s: float, log=print) -> None:
        self.demo = demo
        self.duration_s, self.warmup_s, self.fault_every_s = duration_s, warmup_s, fault_every_s
        self.rate, self.concurrency, self.sample_every_s = rate, concurrency, sample_every_s
        self.run = Run()
        self.traffic = Traffic()
        self.gate = asyncio.Event()
        self.log = log
        self.t0 = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._backend_turn = 0

    def now(self) -> float:
        """Seconds since the traffic started."""
        return time.time() - self.t0

    async def _get(self, url: str) -> bytes | None:
        assert self._http is not None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self._http.get(url) as r:
                if r.status == 200:
                    return await r.read()
        return None

    async def picker_in_flight(self) -> int | None:
        """Sum of ``inferlb_ext_proc_in_flight`` over clusters (None: the admin API did not answer)."""
        body = await self._get(f"{self.demo.admin}/metrics")
        if body is None:
            return None
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith("inferlb_ext_proc_in_flight{"):
                total += float(line.rsplit(" ", 1)[1])
        return round(total)

    async def backends_running(self) -> int | None:
        """Sum of running + waiting over every backend's ``/sim/state`` (None: one did not answer)."""
        states = await asyncio.gather(*(self._get(f"http://127.0.0.1:{p}/sim/state")
                                        for _, _, p in self.demo.backends))
        if any(s is None for s in states):
            return None
        return sum(d["running"] + d["waiting"] for d in map(json.loads, states))

    async def probe(self, since: float, limit_s: float) -> tuple[float | None, int | None, int | None]:
        """Hold new requests, let those in flight finish, then read both counts every ``PROBE_EVERY_S``
        until both are 0 or ``limit_s`` after ``since`` (s since start). Returns (settle s from
        ``since`` or None, last picker count, last backends count); traffic resumes after."""
        self.gate.clear()
        try:
            while self.traffic.in_flight and self.now() < since + limit_s + 30:
                await asyncio.sleep(0.05)
            picker = backends = None
            while True:
                picker, backends = await asyncio.gather(self.picker_in_flight(), self.backends_running())
                if picker == 0 and backends == 0:
                    return round(max(0.0, self.now() - since), 2), picker, backends
                if self.now() >= since + limit_s:
                    return None, picker, backends
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            self.gate.set()

    async def _sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = round(self.now(), 2)
            for name, proc in list(self.demo.procs.items()):
                got = proc_usage(proc.popen.pid) if proc.alive() else None
                if got is not None:
                    self.run.usage.append({"t": t, "process": name, "pid": proc.popen.pid,
                                           "rss_mib": round(got[0], 2), "fds": got[1]})
            if self.gate.is_set():
                picker, backends = await asyncio.gather(self.picker_in_flight(), self.backends_running())
                self.run.drift.append({"t": t, "picker": picker, "backends": backends,
                                       "client": self.traffic.in_flight})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sample_every_s):   # not wait_for: it can lose a cancellation on 3.11
                    await stop.wait()

    def _inject(self, kind: str) -> tuple[str, tuple[int, int]]:
        """Run one fault to its end (blocking; called in a thread). Returns the target's name and its
        pids before and after."""
        demo = self.demo
        if kind == "backend-restart":
            port = demo.backends[self._backend_turn % len(demo.backends)][2]
            self._backend_turn += 1
            old = demo.procs[f"sim-{port}"]
            old.kill()
            time.sleep(BACKEND_DOWN_S)
            new = demo.restart_sim(port)
        elif kind == "prometheus-pause":
            old = new = demo.procs["prometheus"]
            old.popen.send_signal(signal.SIGSTOP)
            try:
                time.sleep(PROMETHEUS_PAUSE_S)
            finally:
                old.popen.send_signal(signal.SIGCONT)
        else:
            old = demo.procs["inferlb"]
            new = demo.restart_control_plane()
        return new.name, (old.popen.pid, new.popen.pid)

    async def _faults(self) -> None:
        for at, kind in fault_schedule(self.duration_s, self.warmup_s, self.fault_every_s):
            await asyncio.sleep(max(0.0, at - self.now()))
            fault = Fault(kind, "", round(self.now(), 2))
            self.log(f"soak t={fault.start:7.1f}s: {kind}")
            fault.target, fault.pids = await asyncio.to_thread(self._inject, kind)
            fault.end = round(self.now(), 2)
            self.run.faults.append(fault)
            fault.settle_s, fault.picker_in_flight, fault.backends_running = await self.probe(fault.end, SETTLE_S)
            self.log(f"soak t={self.now():7.1f}s: {kind} on {fault.target} ended at {fault.end:.1f}s; "
                     f"in-flight settled in {fault.settle_s} s (picker {fault.picker_in_flight}, "
                     f"backends {fault.backends_running})")

    async def _warmup_probe(self) -> None:
        await asyncio.sleep(max(0.0, self.warmup_s - self.now()))
        at = self.now()
        settle, picker, backends = await self.probe(at, SETTLE_S)
        self.run.probes.append({"at": "warm-up end", "t": round(at, 2), "settle_s": settle,
                                "picker": picker, "backends": backends})

    async def main(self) -> None:
        """Drive traffic for ``duration_s`` with the faults and samplers running, then the final probe."""
        sessions = make_sessions(48, ["v1", "v2", None], unsessioned_share=0.25, seed=7)
        stop = asyncio.Event()
        self.gate.set()
        self.t0 = time.time()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            self._http = http
            sampler = asyncio.create_task(self._sampler(stop))
            chaos = asyncio.create_task(self._faults())
            warm = asyncio.create_task(self._warmup_probe())
            try:
                await drive("http://127.0.0.1:10000/v1/chat/completions", sessions, duration_s=self.duration_s,
                            concurrency=self.concurrency, traffic=self.traffic, stream_share=0.8,
                            system_prompt=DEMO_SYSTEM_PROMPT, rate=self.rate, gate=self.gate)
                await chaos
                await warm
                at = self.now()
                settle, picker, backends = await self.probe(at, SETTLE_S)
                self.run.probes.append({"at": "end", "t": round(at, 2), "settle_s": settle,
                                        "picker": picker, "backends": backends})
                stats = await self._get(f"{self.demo.envoy_admin}/stats?filter=ext_proc|grpc_access_log")
                for line in (stats or b"").decode().splitlines():
                    name, _, value = line.partition(": ")
                    if value.isdigit() and not name.startswith("cluster."):
                        self.run.envoy[name] = int(value)
            finally:
                stop.set()
                await sampler
                for task in (chaos, warm):
                    task.cancel()


def _drift_summary(drift: list[dict]) -> dict:
    diffs = [d["picker"] - d["backends"] for d in drift if d["picker"] is not None and d["backends"] is not None]
    if not diffs:
        return {"samples": 0}
    return {"samples": len(diffs), "median": statistics.median(diffs), "min": min(diffs), "max": max(diffs),
            "unreadable": len(drift) - len(diffs)}


def report(soak: Soak, command: str, envoy_version: str) -> dict:
    """The result document (JSON-able) of a finished soak, with its ``targets`` and ``ok``."""
    run = soak.run
    growth = memory_growth(run.usage, soak.warmup_s)
    held = [g for name, gs in growth.items() if name not in MEMORY_REPORT_ONLY for g in gs]
    worst = max((g["growth_pct"] for g in held), default=None)
    errors = errors_by_cause(soak.traffic.results, windows(run.faults), soak.t0)
    settles = [f.settle_s for f in run.faults] + [p["settle_s"] for p in run.probes]
    targets = {
        "memory_growth_pct": {"value": worst, "limit": MEMORY_GROWTH_LIMIT_PCT,
                              "ok": worst is not None and worst <= MEMORY_GROWTH_LIMIT_PCT},
        "failed_outside_windows": {"value": errors["failed_outside"], "limit": 0, "ok": errors["failed_outside"] == 0},
        "drift_settle_s": {"value": None if None in settles else max(settles, default=0.0), "limit": SETTLE_S,
                           "ok": None not in settles and bool(run.faults)},
    }
    return {
        "benchmark": "soak",
        "command": command,
        "started_at": datetime.datetime.fromtimestamp(soak.t0, datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True},
        "envoy_version": envoy_version,
        "duration_s": soak.duration_s, "warmup_s": soak.warmup_s, "fault_every_s": soak.fault_every_s,
        "rate_per_s": soak.rate, "concurrency": soak.concurrency, "settle_s": SETTLE_S,
        "requests": soak.traffic.summary(default_version="v1")["requests"],
        "errors": errors,
        "faults": [asdict(f) for f in run.faults],
        "probes": run.probes,
        "drift_under_traffic": _drift_summary(run.drift),
        "envoy_counters": run.envoy,
        "processes": growth,
        "targets": targets,
        "ok": all(t["ok"] for t in targets.values()),
    }


def markdown(doc: dict) -> str:
    """The BENCHMARKS.md section (between :data:`BEGIN` and :data:`END`) of a result document."""
    t = doc["targets"]
    mark = {True: "met", False: "**missed**"}
    lines = [
        BEGIN,
        f"Measured {doc['started_at']} with `{doc['command']}` (run inside `unshare -n`), "
        f"{doc['duration_s'] / 60:g} min at {doc['rate_per_s']:g} requests/s (at most {doc['concurrency']} in flight, "
        f"80 % streamed, 48 sessions over v1 / v2 / no version, plus anonymous ones), warm-up {doc['warmup_s']:g} s, "
        f"one fault every {doc['fault_every_s']:g} s, Envoy {doc['envoy_version']}. "
        f"The machine ({doc['machine']['cpus']} cores) was shared with other work during the run.",
        "",
        f"Requests: {doc['requests']['total']} sent, {doc['requests']['ok']} answered 2xx, "
        f"{doc['requests']['errors']} not.",
        "",
        "| target | measured | limit | |",
        "|---|---|---|---|",
        f"| memory growth after warm-up (worst process incarnation) | {t['memory_growth_pct']['value']} % | "
        f"<= {t['memory_growth_pct']['limit']:g} % | {mark[t['memory_growth_pct']['ok']]} |",
        f"| failures (5xx or no answer) outside the faults' windows | {t['failed_outside_windows']['value']} | 0 | "
        f"{mark[t['failed_outside_windows']['ok']]} |",
        f"| in-flight drift back to 0 after a fault (worst) | {t['drift_settle_s']['value']} s | "
        f"<= {t['drift_settle_s']['limit']:g} s | {mark[t['drift_settle_s']['ok']]} |",
        "",
        "| fault | target | window (s) | failures in window | in-flight back to 0 after |",
        "|---|---|---|---|---|",
    ]
    by_fault = doc["errors"]["by_fault"]
    for f in doc["faults"]:
        lines.append(f"| {f['kind']} | {f['target']} | {f['start']:.0f}-{f['end'] + doc['settle_s']:.0f} | "
                     f"{sum(by_fault.get(f['kind'], {}).values())} (all {f['kind']} windows) | "
                     f"{f['settle_s']} s |")
    lines += ["", "| process | incarnation (s) | RSS MiB first -> last | growth | open files first -> last |",
              "|---|---|---|---|---|"]
    for name, incarnations in doc["processes"].items():
        for g in incarnations:
            note = " (reported only)" if name in MEMORY_REPORT_ONLY else ""
            lines.append(f"| {name}{note} | {g['from_s']:.0f}-{g['to_s']:.0f} | "
                         f"{g['rss_mib'][0]} -> {g['rss_mib'][1]} | {g['growth_pct']} % | "
                         f"{g['fds'][0]:g} -> {g['fds'][1]:g} |")
    causes = ", ".join(f"{c}: {n}" for k, cs in by_fault.items() for c, n in cs.items()) or "none"
    outside = ", ".join(f"{c}: {n}" for c, n in doc["errors"]["outside"].items()) or "none"
    d = doc["drift_under_traffic"]
    lines += [
        "",
        f"Failed requests by cause, inside the faults' windows: {causes}; outside: {outside}.",
        f"Picker in-flight minus the backends' running + waiting, sampled under traffic ({d.get('samples', 0)} "
        f"samples; includes requests in transit and the access-log flush delay): median {d.get('median')}, "
        f"range {d.get('min')} to {d.get('max')}.",
        "Envoy's counters at the end: " + (", ".join(f"`{k}` {v}" for k, v in doc["envoy_counters"].items() if v)
                                           or "all 0") + ".",
        END,
    ]
    return "\n".join(lines) + "\n"


def run_soak(*, duration_s: float, warmup_s: float, fault_every_s: float, rate: float, concurrency: int,
             workdir: str | None, command: str) -> dict:
    """Start the demo stack, run the soak, stop everything; returns :func:`report`'s document.

    Raises:
        stack.StackError: the stack did not start (a port in use, a missing binary, ...).
    """
    from inferlb.demo import start_stack

    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="inferlb-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    started: list[stack.Proc] = []
    demo = None
    try:
        demo = start_stack(work, "prometheus", started=started)
        sample_every = max(1.0, min(10.0, duration_s / 120))
        soak = Soak(demo, duration_s=duration_s, warmup_s=warmup_s, fault_every_s=fault_every_s, rate=rate,
                    concurrency=concurrency, sample_every_s=sample_every)
        asyncio.run(soak.main())
        doc = report(soak, command, stack.envoy_version())
        doc["workdir"] = str(work)
        return doc
    finally:
        stack.stop_all(list(demo.procs.values()) if demo else started)


def write_markdown(path: Path, doc: dict) -> None:
    """(Re)write the soak section of the BENCHMARKS.md at ``path``."""
    replace_marked(path, BEGIN, END, markdown(doc), heading="## Soak")
