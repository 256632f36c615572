"""Run one scenario against every policy: the processes, the replay, the events, Envoy's weights.

The I/O shell around the pure parts. Per scenario: the simulated backends and Prometheus start
once; then the policies run in *rounds*, every policy once per round, the order rotated by one
each round (so a busy stretch of the shared machine does not land on one policy only). Per run, a
fresh Envoy (and, for inferlb policies, a fresh ``inferlb serve``) starts, the whole trace is
replayed open-loop while the scenario's events fire at their times and Envoy's per-host weights
are polled, and everything but the backends and Prometheus stops again. Between runs each
backend's faults are reset and a stopped backend is restarted; session keys and prompt texts
differ per run (see :func:`bench.quality.trace.to_planned`), so no run inherits warm KV caches,
and a run starts once the one before it has left Prometheus's window (:data:`QUIET_S`).
The backends' prefix-cache and preemption counters are read at the end of the warm-up and at the
end of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.progress import Progress
from bench.quality import figures
from bench.quality.policies import (
    BASELINES,
    GATEWAY_POLICIES,
    SESSION_HEADER,
    SLOW_VIEW_INTERVAL_S,
    VERSION_HEADER,
    baseline_bootstrap,
    eds_document,
    gateway_count,
    inferlb_config,
)
from bench.quality.scenarios import CONTROL, SIM_ARGS, Event, Scenario
from bench.quality.spans import peak_in_flight
from bench.quality.tiers import tier_figures
from bench.quality.trace import TraceRequest, build_trace, to_planned
from inferlb.devstack import stack
from inferlb.devstack.envoy_admin import envoy_hosts
from inferlb.devstack.gateway import gateway_bootstrap, start_gateway_picker
from inferlb.devstack.loadgen import Planned, Result, Traffic, replay
from xds_server.config import load_config
from xds_server.config.model import EndpointConfig, Picker
from xds_server.resources.bootstrap import render_bootstrap

log = logging.getLogger(__name__)

#: How often Envoy's weights are read during a run (s).
WEIGHT_POLL_S = 0.5
#: Envoy's route timeout is the client's plus this (s), so the client's timeout decides.
ROUTE_TIMEOUT_SLACK_S = 1.0
#: Pause between two runs (s): Prometheus's window plus one scrape, so no run's control plane reads
#: the traffic of the run before it.
QUIET_S = CONTROL["window_s"] + CONTROL["scrape_interval_s"]
#: inferlb's max concurrency of an endpoint whose node states none, and the edge's spill threshold (its defaults).
DEFAULT_MAX_CONCURRENCY: int = EndpointConfig.model_fields["max_concurrency"].default
SPILL_THRESHOLD: float = Picker.model_fields["spill_threshold"].default


def edge_capacity(scenario: Scenario) -> int:
    """Requests the edge nodes of ``scenario`` take at once as inferlb is configured: the sum of their
    endpoints' ``max_concurrency``."""
    return sum(DEFAULT_MAX_CONCURRENCY if n.max_concurrency is None else n.max_concurrency
               for n in scenario.nodes if n.tier == "edge")


@dataclass
class PolicyRun:
    """One policy's run in one round: its figures, the measured successful end-to-end latencies
    and TTFTs (ms, for the CDFs), Envoy's weights over time as ``(t_s, cluster, address, weight,
    health)`` (t from the replay start), the events as ``(t_s, label)`` when they were applied, the
    replay's worst send lag (ms) and the measured requests each node answered."""

    policy: str
    figures: dict[str, float | None]
    latencies_ms: list[float]
    weights: list[tuple[float, str, str, int, str]]
    events: list[tuple[float, str]]
    max_lag_ms: float
    served: dict[str, int]
    round: int = 0
    ttfts_ms: list[float] = field(default_factory=list)


@dataclass
class ScenarioRun:
    """Every policy's runs of one scenario (``runs[policy]``: one per round, in round order), with
    the node addresses, the trace's shape and each round's policy order."""

    scenario: Scenario
    quick: bool
    seed: int
    warmup_s: float
    measure_s: float
    requests: int
    addresses: list[str]
    runs: dict[str, list[PolicyRun]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    wall_s: float = 0.0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def node_label(self, address: str) -> str:
        """``n<i> <gpu> <engine> <version>`` for a node address (the address itself if unknown)."""
        if address not in self.addresses:
            return address
        i = self.addresses.index(address)
        n = self.scenario.nodes[i]
        return f"n{i} {n.gpu_class} {n.engine} {n.version}"


def _post_json(url: str, body: dict, timeout: float = 5.0) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def round_orders(policies: list[str], rounds: int) -> list[list[str]]:
    """Each round's policy order: every policy once, the list rotated by one more each round."""
    n = len(policies)
    return [policies[r % n:] + policies[:r % n] for r in range(rounds)] if n else []


def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "preemptions")


def _event_label(e: Event) -> str:
    if e.kind == "fault":
        return f"n{e.node} " + ", ".join(f"{k}={v}" for k, v in e.patch.items())
    return f"{e.kind} n{e.node}"


class ScenarioRunner:
    """Runs one scenario (all its policies) in ``workdir``; ``seed`` seeds the trace and the backends."""

    def __init__(self, scenario: Scenario, *, quick: bool, seed: int, workdir: Path) -> None:
        self.sc = scenario
        self.quick = quick
        self.seed = seed + zlib.crc32(scenario.name.encode()) % 1000
        self.work = workdir / scenario.name
        self.warmup_s, self.measure_s = scenario.durations(quick)
        self.trace: list[TraceRequest] = build_trace(scenario.traffic, self.warmup_s + self.measure_s, self.seed)
        self.ports = [stack.free_port() for _ in scenario.nodes]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.sims: list[stack.Proc | None] = [None] * len(scenario.nodes)
        self.prometheus: stack.Proc | None = None
        self.prometheus_port = 0  # chosen right before Prometheus starts (see _start_backends)
        self._last_run_ended = float("-inf")  # monotonic s: when the previous policy's traffic stopped

    # --- backends and Prometheus (once per scenario) ----------------------------------------------

    def _start_sim(self, i: int) -> stack.Proc:
        node = self.sc.nodes[i]
        extra = ["--engine", node.engine, "--time-scale", str(self.sc.time_scale), "--seed", str(self.seed + i),
                 "--log-level", "warning", *SIM_ARGS]
        if node.gpu_memory_mib is not None:
            extra += ["--gpu-memory-mib", str(node.gpu_memory_mib)]
        return stack.start_sim(self.ports[i], self.work, gpu_class=node.gpu_class, version=node.version,
                               name=f"sim-n{i}", extra=extra)

    def _start_backends(self) -> None:
        with ThreadPoolExecutor(len(self.ports)) as pool:
            for i, proc in enumerate(pool.map(self._start_sim, range(len(self.ports)))):
                self.sims[i] = proc
        # A free port picked long before the bind can meanwhile be taken as the source port of an
        # outgoing connection (one run failed so: "address already in use"): pick it just before.
        self.prometheus_port = stack.free_port()
        self.prometheus = stack.start_prometheus(self.addresses, self.work / "prometheus", self.prometheus_port,
                                                 CONTROL["scrape_interval_s"])

    def _reset_backends(self) -> None:
        """Every node running, without faults; a node that joins later answers /metrics with 503."""
        for i, node in enumerate(self.sc.nodes):
            proc = self.sims[i]
            if proc is None or not proc.alive():
                self.sims[i] = self._start_sim(i)
            self._fault(i, {"reset": True})
            if not node.present:
                self._fault(i, {"metrics": "error"})

    def _fault(self, i: int, patch: dict) -> None:
        _post_json(f"http://{self.addresses[i]}/sim/fault", patch)

    def _counters(self, i: int) -> dict[str, int] | None:
        """Node ``i``'s prefix-cache and preemption counters, or None when it does not answer."""
        try:
            c = _get_json(f"http://{self.addresses[i]}/sim/state", 2.0)["counters"]
        except (OSError, ValueError, KeyError):
            return None
        return {k: int(c.get(k, 0)) for k in _COUNTERS}

    def _spans(self, i: int, since: float) -> list[tuple[float, float]] | None:
        """Node ``i``'s request spans that ended at or after ``since`` (wall s), or None when it does not
        answer (:mod:`bench.quality.spans`)."""
        try:
            return [(float(a), float(b)) for a, b in _get_json(f"http://{self.addresses[i]}/sim/spans?since={since!r}",
                                                              5.0)["spans"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _stop_all(self) -> None:
        for p in [*self.sims, self.prometheus]:
            if p is not None:
                p.stop()

    # --- one policy --------------------------------------------------------------------------------

    def run(self, policies: list[str], rounds: int = 1, progress: Progress | None = None) -> ScenarioRun:
        """Every policy in ``policies``, ``rounds`` times, interleaved (see :func:`round_orders`), on
        the same trace. Raises ``StackError`` when a process does not start. The machine's load
        averages before and after are recorded (other work on the machine shares its cores).
        ``progress``: told of each (policy, round) as it starts."""
        began = time.monotonic()
        out = ScenarioRun(self.sc, self.quick, self.seed, self.warmup_s, self.measure_s, len(self.trace),
                          list(self.addresses), load_before=os.getloadavg())
        out.orders = round_orders(policies, rounds)
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            self._start_backends()
            for r, order in enumerate(out.orders):
                for policy in order:
                    if progress is not None:
                        progress.step(f"{self.sc.name}, {policy}, round {r + 1}/{len(out.orders)}")
                    pr = self._run_policy(policy, r)
                    out.runs.setdefault(policy, []).append(pr)
                    f = pr.figures
                    log.warning("%s / %s (round %d): %d requests, TTFT p90 %s ms, p95 %s ms, prefix hits %s, "
                                "errors %.3f, OOM %.3f", self.sc.name, policy, r + 1, f["requests"],
                                _r(f["ttft_p90_ms"]), _r(f["p95_ms"]), _r(f["prefix_hit_rate"], 3),
                                f["error_rate"] or 0.0, f["oom_rate"] or 0.0)
        finally:
            self._stop_all()
        out.wall_s = time.monotonic() - began
        out.load_after = os.getloadavg()
        return out

    def _run_policy(self, policy: str, round_: int = 0) -> PolicyRun:
        self._reset_backends()
        # Every policy starts with the previous one's traffic out of Prometheus's window: a control
        # plane started right after it judged the nodes by that run's load (an edge node ejected
        # for 30 s as a latency outlier by the last run's bursts, 2026-12-03: 23 % of that round's
        # calm requests went to the cloud).
        time.sleep(max(0.0, self._last_run_ended + QUIET_S - time.monotonic()))
        work = self.work / f"{policy}-r{round_}"
        work.mkdir(parents=True, exist_ok=True)
        listener, envoy_admin_port = stack.free_port(), stack.free_port()
        route_timeout = self.sc.timeout_s + ROUTE_TIMEOUT_SLACK_S
        present = {i for i, n in enumerate(self.sc.nodes) if n.present}
        procs: list[stack.Proc] = []
        eds = _EdsFile(work) if policy in BASELINES else None
        try:
            if eds is not None:
                eds.write([self.addresses[i] for i in sorted(present)])
                boot = yaml.safe_dump(baseline_bootstrap(
                    policy, listener_port=listener, admin_port=envoy_admin_port, eds_path=str(eds.path),
                    eds_dir=str(eds.path.parent), route_timeout_s=route_timeout))
            else:
                xds, admin = stack.free_port(), stack.free_port()
                cfg = inferlb_config(self.sc, self.addresses, picker=policy != "inferlb_eds",
                                     prometheus_url=f"http://127.0.0.1:{self.prometheus_port}",
                                     xds_port=xds, admin_port=admin,
                                     listener_port=listener, route_timeout_s=route_timeout,
                                     shared_view=policy != "inferlb_no_shared_view",
                                     view_interval_s=(SLOW_VIEW_INTERVAL_S if policy == "inferlb_shared_view_100ms"
                                                      else 0.01))
                cfg_path = work / "inferlb.yaml"
                cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                cp = stack.start_control_plane(cfg_path, work, admin)
                procs.append(cp)
                stack.wait_http(f"http://127.0.0.1:{admin}/readyz", cp)
                boot = "" if policy in GATEWAY_POLICIES else render_bootstrap(
                    xds_address=f"127.0.0.1:{xds}", node_id=f"bench-{policy}", admin_port=envoy_admin_port)
            listeners = [listener]
            if policy in GATEWAY_POLICIES:
                listeners, envoy_admin_port = self._start_gateways(gateway_count(self.sc, policy), cfg_path, xds,
                                                                   admin, work, procs)
            else:
                envoy = stack.start_envoy(boot, work, envoy_admin_port)
                procs.append(envoy)
                stack.wait_http(f"http://127.0.0.1:{envoy_admin_port}/ready", envoy, timeout=20)
            envoy_admin = f"http://127.0.0.1:{envoy_admin_port}"
            self._last: dict[int, dict[str, int]] = {}
            self._last_spans: dict[int, list[tuple[float, float]]] = {}
            traffic, weights, events, started, before = asyncio.run(
                self._drive(f"{policy}-r{round_}", listeners, envoy_admin, eds, present))
        finally:
            self._last_run_ended = time.monotonic()
            stack.stop_all(procs)
        after = {i: c for i in range(len(self.addresses)) if (c := self._counters(i) or self._last.get(i))}
        backends = figures.BackendCounters(**{k: sum(after[i][k] - before.get(i, {}).get(k, 0) for i in after)
                                              for k in _COUNTERS})
        since = started + self.warmup_s
        spans = {i: s for i in range(len(self.addresses))
                 if (s := self._spans(i, since) or self._last_spans.get(i)) is not None}
        pr = self._summarise(policy, round_, traffic, weights, events, started, backends, spans)
        if self.sc.gateways > 1:
            pr.figures["peak_in_flight"] = max((peak_in_flight(s, since) for s in spans.values()), default=None)
        return pr

    def _start_gateways(self, n: int, cfg_path: Path, xds: int, admin: int, work: Path,
                        procs: list[stack.Proc]) -> tuple[list[int], int]:
        """``n`` Envoy + standalone picker pairs on the control plane at ``xds``; returns their listener
        ports and the first Envoy's admin port, once every picker reports to the load view."""
        cfg = load_config(cfg_path)
        listeners, admins = [], []
        for g in range(n):
            picker_port, listener, envoy_admin = stack.free_port(), stack.free_port(), stack.free_port()
            procs.append(start_gateway_picker(f"127.0.0.1:{xds}", picker_port, work, f"gw-{g}"))
            boot = gateway_bootstrap(cfg, xds_address=f"127.0.0.1:{xds}", node_id=f"gw-{g}-envoy",
                                     admin_port=envoy_admin, listener_port=listener,
                                     picker_address=f"127.0.0.1:{picker_port}")
            envoy = stack.start_envoy(boot, work, envoy_admin, name=f"envoy-gw-{g}")
            procs.append(envoy)
            stack.wait_http(f"http://127.0.0.1:{envoy_admin}/ready", envoy, timeout=20)
            listeners.append(listener)
            admins.append(envoy_admin)
        deadline = time.monotonic() + 20
        while True:
            names = {p["picker"] for p in _get_json(f"http://127.0.0.1:{admin}/api/v1/pickers")["pickers"]}
            if {f"gw-{g}" for g in range(n)} <= names:
                return listeners, admins[0]
            if time.monotonic() > deadline:
                raise stack.StackError(f"the gateways' pickers did not all report to the load view: {sorted(names)}")
            time.sleep(0.1)

    async def _replay(self, listeners: list[int], planned: list[Planned]) -> Traffic:
        """The trace through one listener, or split over several gateways: a session always through
        the same one (by its number), a single request by its position in the trace."""
        kwargs = {"timeout_s": self.sc.timeout_s, "session_header": SESSION_HEADER, "version_header": VERSION_HEADER}
        urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in listeners]
        if len(urls) == 1:
            return await replay(urls[0], planned, **kwargs)
        parts: list[list[int]] = [[] for _ in urls]
        for i, t in enumerate(self.trace):
            parts[(t.session if t.session is not None else i) % len(urls)].append(i)
        traffics = await asyncio.gather(*(replay(u, [planned[i] for i in idx], **kwargs)
                                          for u, idx in zip(urls, parts, strict=True)))
        out = Traffic(max_lag_ms=max(t.max_lag_ms for t in traffics))
        for t, idx in zip(traffics, parts, strict=True):
            out.results += [dataclasses.replace(r, index=idx[r.index]) for r in t.results]
        return out

    async def _drive(self, run_key: str, listeners: list[int], envoy_admin: str, eds: _EdsFile | None,
                     present: set[int]):
        planned = to_planned(self.trace, f"{run_key}-{self.seed}", self.sc.traffic)
        before: dict[int, dict[str, int]] = {}
        weights: list[tuple[float, str, str, int, str]] = []
        events: list[tuple[float, str]] = []
        loop = asyncio.get_running_loop()
        started = time.time()
        t0 = loop.time()
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                try:
                    hosts = await asyncio.to_thread(envoy_hosts, envoy_admin)
                except OSError as err:
                    log.warning("cannot read Envoy's weights: %s", err)
                    hosts = {}
                t = loop.time() - t0
                weights.extend((t, c, a, h["weight"], h["health"]) for c, hs in hosts.items() for a, h in hs.items())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WEIGHT_POLL_S):   # not wait_for: it can lose a cancellation on 3.11
                        await done.wait()

        async def fire() -> None:
            for e in sorted(self.sc.events, key=lambda e: e.at):
                await asyncio.sleep(max(0.0, t0 + self.warmup_s + e.at * self.measure_s - loop.time()))
                await asyncio.to_thread(self._apply, e, eds, present)
                events.append((loop.time() - t0, _event_label(e)))

        async def mark_warmup_end() -> None:
            await asyncio.sleep(max(0.0, t0 + self.warmup_s - loop.time()))
            for i in range(len(self.addresses)):
                c = await asyncio.to_thread(self._counters, i)
                if c is not None:
                    before[i] = c

        tasks = [asyncio.create_task(poll()), asyncio.create_task(fire()), asyncio.create_task(mark_warmup_end())]
        try:
            traffic = await self._replay(listeners, planned)
        finally:
            done.set()
            tasks[1].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return traffic, weights, events, started, before

    def _apply(self, e: Event, eds: _EdsFile | None, present: set[int]) -> None:
        """Apply one event (blocking): a fault, a node joining, or a node leaving."""
        if e.kind == "fault":
            self._fault(e.node, dict(e.patch))
            return
        if e.kind == "add":
            present.add(e.node)
            self._fault(e.node, {"metrics": "ok"})
        else:
            present.discard(e.node)
        if eds is not None:
            eds.write([self.addresses[i] for i in sorted(present)])
        if e.kind == "remove":
            proc = self.sims[e.node]
            if proc is not None:
                last = self._counters(e.node)
                if last is not None:
                    self._last[e.node] = last
                spans = self._spans(e.node, 0.0)
                if spans is not None:
                    self._last_spans[e.node] = spans
                proc.stop()

    def _summarise(self, policy: str, round_: int, traffic: Traffic, weights, events, started: float,
                   backends: figures.BackendCounters, spans: dict[int, list[tuple[float, float]]]) -> PolicyRun:
        results: list[Result] = traffic.results
        adds = sorted(e.at for e in self.sc.events if e.kind == "add")
        later = sorted(e.at for e in self.sc.events if adds and e.at > adds[0])
        window = figures.RunWindow(
            started=started, warmup_s=self.warmup_s, default_version=self.sc.default_version,
            multi_version=len(self.sc.versions) > 1,
            scale_up_s=self.warmup_s + adds[0] * self.measure_s if adds else None,
            next_event_s=self.warmup_s + later[0] * self.measure_s if later else None,
        )
        figs = figures.compute(self.trace, results, window, backends)
        cloud = {a for a, n in zip(self.addresses, self.sc.nodes, strict=True) if n.tier == "cloud"}
        if cloud:
            edge = set(self.addresses) - cloud
            edge_spans = [s for i, a in enumerate(self.addresses) if a in edge for s in spans.get(i, ())]
            cloud_spans = [s for i, a in enumerate(self.addresses) if a in cloud for s in spans.get(i, ())]
            figs.update(tier_figures(self.trace, results, self.warmup_s, started, edge, cloud,
                                     edge_capacity(self.sc), SPILL_THRESHOLD, edge_spans, cloud_spans))
        measured_ok = [r for r in results if 200 <= r.status < 300 and self.trace[r.index].at_s >= self.warmup_s]
        served: dict[str, int] = {}
        for r in measured_ok:
            if r.served_by:
                served[r.served_by] = served.get(r.served_by, 0) + 1
        return PolicyRun(policy, figs, sorted(r.latency_ms for r in measured_ok), weights, events,
                         traffic.max_lag_ms, served, round_,
                         sorted(r.ttft_ms for r in measured_ok if r.stream and r.ttft_ms is not None))


def _r(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


class _EdsFile:
    """The baselines' filesystem EDS: written elsewhere, then moved into the watched directory."""

    def __init__(self, work: Path) -> None:
        self.path = work / "eds" / "chat.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = work / "eds.json.tmp"

    def write(self, addresses: list[str]) -> None:
        self._tmp.write_text(json.dumps(eds_document(addresses)))
        os.replace(self._tmp, self.path)
