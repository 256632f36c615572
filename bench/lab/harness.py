"""The lab's discrete-event harness: one policy, one cluster, one QPS point, in virtual time.

Everything happens in time order on one thread: arrivals (the workload's, and a session's next
turn ``think_s`` after its previous one ended, answered or failed), the engines' own events (each
engine is advanced to its next event time, or at once after a request is sent to it, and no
further, so an engine's state is exact whenever anything else happens), the slow loop's scrapes
and weight rounds, the policy's own scrapes, the delivery of its requests' progress (at once for a
proxy, in access-log flushes for inferlb's picker), KV events, the policy's wake-ups (a held
request's timeout) and the scenario's faults (a node joins, leaves, turns slow). No sockets, no
sleeps, no threads, no wall clock: the same :class:`RunSpec` gives the same records, bit for bit.

A request is *measured* when it arrives within ``[warmup_s, duration_s)``. Arrivals stop at
``duration_s``; the run goes on until every measured request has ended or ``drain_s`` more has
passed (a request still open then is counted unfinished, its TTFT censored at the run's end).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bench.lab.cluster import Cluster, SlowLoopTiming
from bench.lab.engines import EngineHandle, make_engines, sample_values
from bench.lab.policy import (
    Answer,
    Context,
    Finished,
    FirstToken,
    KvEvents,
    Policy,
    Progress,
    Reject,
    Request,
    Route,
    Sample,
    Wait,
)
from bench.lab.slowloop import EndpointCounters, SlowLoop
from bench.lab.workloads.base import Draft, Sizing, Workload
from bench.lab.workloads.tokens import prompt_keys
from sim.engines.api import FAIL_OOM, EngineRequest, Failed
from sim.engines.api import Finished as EngineFinished
from sim.engines.api import FirstToken as EngineFirstToken

__all__ = ["LONG_TAIL_FACTOR", "Fault", "Record", "RunResult", "RunSpec", "run"]

#: A long-tail request runs this many times slower (the seed's trap: ``sim``'s ``long_tail`` fault).
LONG_TAIL_FACTOR = 10.0

_ARRIVAL, _FOLLOW, _SCRAPE, _ROUND, _POLICY_SCRAPE, _FLUSH, _KV, _WAKE, _FAULT, _WARMUP = range(10)
_BASE_HEADERS = (
    (":method", b"POST"), (":path", b"/v1/chat/completions"), (":authority", b"lab"),
    ("content-type", b"application/json"),
)


@dataclass(frozen=True)
class Fault:
    """Something that happens to node ``node`` at ``at_s`` (virtual s): ``add`` (it joins: scraped and
    reachable from then on), ``remove`` (it leaves discovery; its requests fail), ``long_tail``
    (``value``: the share of its requests from then on that run :data:`LONG_TAIL_FACTOR` times
    slower; 0 ends it), ``slow`` (its GPU runs ``value`` times slower from then on)."""

    at_s: float
    kind: Literal["add", "remove", "long_tail", "slow"]
    node: int
    value: float = 0.0


@dataclass(frozen=True)
class RunSpec:
    """One run.

    Attributes:
        cluster: the nodes.
        workload: the request generator.
        qps: the offered rate (requests per s).
        duration_s: arrivals stop here (virtual s).
        warmup_s: requests arriving before this are not measured.
        drain_s: how long after ``duration_s`` the measured requests may take to end.
        seed: every random draw of the run (workload, policy, faults) follows from it.
        timing: the slow loop's delays.
        gateways: policy instances the arrivals are split over (round robin by request id).
        faults: the scenario's faults, in any order.
    """

    cluster: Cluster
    workload: Workload
    qps: float
    duration_s: float
    warmup_s: float = 0.0
    drain_s: float = 60.0
    seed: int = 1
    timing: SlowLoopTiming = SlowLoopTiming()
    gateways: int = 1
    faults: tuple[Fault, ...] = ()


@dataclass(slots=True)
class Record:
    """One request's life (times in virtual s; None: did not happen).

    ``status``: 200, an HTTP error the client saw (4xx/5xx) or None (never answered: held or
    unfinished at the end); ``reason``: why it failed (a policy's rejection reason, ``oom``,
    ``context_length``, ``connect-failure``, ``endpoint-gone``, ``unfinished``, ``held``);
    ``wrong_version``: it named a version and was served by another one.
    """

    id: int
    arrival_s: float
    measured: bool
    session: int | None
    gateway: int
    prompt_tokens: int
    output_tokens: int
    sent_s: float | None = None
    endpoint: str | None = None
    first_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    reason: str = ""
    cached_tokens: int = 0
    preemptions: int = 0
    wrong_version: bool = False


@dataclass
class RunResult:
    """What a run leaves: every request's record, the engines' counters at the warm-up's end and at
    the end (by address), the engines' waiting queues as the slow loop's scrapes saw them during the
    measured window, and the time the run stopped."""

    spec: RunSpec
    policy: str
    records: list[Record]
    counters_start: dict[str, dict[str, float]] = field(default_factory=dict)
    counters_end: dict[str, dict[str, float]] = field(default_factory=dict)
    waiting: list[float] = field(default_factory=list)
    ended_s: float = 0.0


class _Clock:
    """The run's virtual time (s), as the policies read it (:attr:`bench.lab.policy.Context.clock`)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Run:
    """The state of one run (see the module docstring); :func:`run` is its entry point."""

    def __init__(self, spec: RunSpec, make_policy: Callable[[], Policy]) -> None:
        self.spec = spec
        cluster = spec.cluster
        self.rng = random.Random(spec.seed)
        self.policies = [make_policy() for _ in range(spec.gateways)]
        self.name = self.policies[0].name
        self.kv_wanted = [g for g, p in enumerate(self.policies) if p.needs.kv_events]
        self.handles: dict[str, EngineHandle] = make_engines(cluster, kv_events=bool(self.kv_wanted))
        self.addresses = list(self.handles)
        self.config = cluster.config(spec.timing, {i: h.max_concurrency for i, h in
                                                   enumerate(self.handles.values())})
        self.slow = SlowLoop(cluster, self.config, spec.timing)
        self.counters = {a: EndpointCounters() for a in self.addresses}
        self.present: set[str] = set()
        self.long_tail: dict[str, float] = {}
        for address, node in zip(self.addresses, cluster.nodes, strict=True):
            if node.present:
                self._join(address)
        self.node_cluster = {a: cluster.cluster_of(i) for i, a in enumerate(self.addresses)}
        self.routes = cluster.routes
        self.block_size = next(iter(self.handles.values())).block_size
        self.now = 0.0
        self.clock = _Clock()  # the policies' copy of ``now``: a policy holding it does not hold the run
        engines = {a: h.engine for a, h in self.handles.items()}
        shared: dict[str, Any] = {}  # what the gateways' instances share (Context.shared)
        for g, p in enumerate(self.policies):
            p.start(Context(clock=self.clock, rng=random.Random(f"{spec.seed}:{p.name}:{g}"),
                            block_size=self.block_size, gateway=g, gateways=spec.gateways,
                            engines=engines if p.needs.engines else {}, config=self.config, shared=shared))
        self.pending_progress: list[list[Progress]] = [[] for _ in self.policies]
        self.flush_at: list[float | None] = [None] * len(self.policies)
        self.wake_at: list[float | None] = [None] * len(self.policies)
        # the queue of timed items and the engines' next events
        self.items: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.eng_heap: list[tuple[float, int, str]] = []
        self.eng_next: dict[str, float | None] = {}
        self.records: list[Record] = []
        self.drafts: dict[int, Draft] = {}
        self.by_request: dict[int, tuple[str, int]] = {}  # request id -> (endpoint, gateway) while in flight
        self.open_measured = 0
        self.arrivals_done = False
        self.result = RunResult(spec, self.name, self.records)

    # --- time -------------------------------------------------------------------------------------

    def push(self, t: float, kind: int, data: Any = None) -> None:
        heapq.heappush(self.items, (t, kind, next(self.seq), data))

    def rekey(self, address: str) -> None:
        t = self.handles[address].engine.next_event_s()
        if t != self.eng_next.get(address):
            self.eng_next[address] = t
            if t is not None:
                heapq.heappush(self.eng_heap, (t, next(self.seq), address))

    # --- the loop ---------------------------------------------------------------------------------

    def execute(self) -> RunResult:
        spec = self.spec
        self.arrivals = self._arrivals()
        self._next_arrival()
        self.push(0.0, _SCRAPE)  # before the first round (same time, lower kind): it sees every present engine
        self.push(0.0, _ROUND)
        for g, p in enumerate(self.policies):
            if p.needs.scrape_interval_s:
                self.push(self.rng.random() * p.needs.scrape_interval_s, _POLICY_SCRAPE, g)
        for fault in sorted(spec.faults, key=lambda f: (f.at_s, f.node)):
            self.push(fault.at_s, _FAULT, fault)
        self.push(spec.warmup_s, _WARMUP)
        stop = spec.duration_s + spec.drain_s
        items, eng_heap, eng_next = self.items, self.eng_heap, self.eng_next
        while True:
            while eng_heap and eng_next.get(eng_heap[0][2]) != eng_heap[0][0]:
                heapq.heappop(eng_heap)
            t_item = items[0][0] if items else math.inf
            t_eng = eng_heap[0][0] if eng_heap else math.inf
            t = min(t_item, t_eng)
            if t > stop or (self.arrivals_done and self.open_measured == 0 and t >= spec.duration_s):
                break
            if t_eng <= t_item:
                _, _, address = heapq.heappop(eng_heap)
                eng_next[address] = None
                self.now = self.clock.now = t
                self.engine_events(address, self.handles[address].engine.advance(t))
                self.rekey(address)
            else:
                t, kind, _, data = heapq.heappop(items)
                self.now = self.clock.now = t
                self.handle(kind, data)
        self.now = self.clock.now = min(max(self.now, spec.duration_s), stop)
        self.finish()
        return self.result

    def handle(self, kind: int, data: Any) -> None:
        if kind == _ARRIVAL:
            self.arrive(data)
            self._next_arrival()
        elif kind == _FOLLOW:
            draft = data()
            if draft is not None:
                self.arrive(draft)
        elif kind == _SCRAPE:
            self.scrape()
            self.push(self.now + self.spec.timing.scrape_interval_s, _SCRAPE)
        elif kind == _ROUND:
            eds = self.slow.round(self.now)
            for g, p in enumerate(self.policies):
                p.on_eds(eds)
                self.poll(g)
            self.push(self.now + self.spec.timing.interval_s, _ROUND)
        elif kind == _POLICY_SCRAPE:
            self.policy_scrape(data)
        elif kind == _FLUSH:
            self.flush(data)
        elif kind == _KV:
            g, batch = data
            self.policies[g].on_kv_events([batch])
            self.poll(g)
        elif kind == _WAKE:
            if self.wake_at[data] is not None and self.wake_at[data] <= self.now:
                self.wake_at[data] = None
                self.poll(data)
        elif kind == _FAULT:
            self.fault(data)
        elif kind == _WARMUP:
            self.result.counters_start = self.counter_snapshot()

    # --- arrivals -----------------------------------------------------------------------------------

    def _arrivals(self) -> Iterator[tuple[float, Draft]]:
        sizing = Sizing(sum(h.kv_tokens for h in self.handles.values()), len(self.handles),
                        min(h.max_model_len for h in self.handles.values()))
        return iter(self.spec.workload.arrivals(self.spec.qps, self.spec.duration_s, sizing,
                                                random.Random(self.rng.getrandbits(64))))

    def _next_arrival(self) -> None:
        got = next(self.arrivals, None)
        if got is None:
            self.arrivals_done = True
        else:
            self.push(got[0], _ARRIVAL, got[1])

    def arrive(self, draft: Draft) -> None:
        now, spec = self.now, self.spec
        rid = len(self.records)
        measured = spec.warmup_s <= now < spec.duration_s
        gateway = rid % len(self.policies)
        rec = Record(rid, now, measured, draft.session, gateway, draft.prompt.tokens, draft.output_tokens)
        self.records.append(rec)
        self.drafts[rid] = draft
        if measured:
            self.open_measured += 1
        headers = dict(_BASE_HEADERS)
        headers["x-request-id"] = b"r%d" % rid
        headers.update(draft.headers)
        request = Request(rid, now, headers, draft.prompt, draft.max_tokens, draft.model, draft.user,
                          True, draft.memory_mib)
        self.answer(gateway, request, self.policies[gateway].decide(request))
        self.schedule_wake(gateway)

    def answer(self, g: int, request: Request, answer: Answer) -> None:
        rec = self.records[request.id]
        if isinstance(answer, Route):
            self.send(g, rec, answer.endpoint)
        elif isinstance(answer, Reject):
            self.close(rec, answer.status, answer.reason)
        elif not isinstance(answer, Wait):
            raise TypeError(f"policy {self.name}: decide() must answer Route, Wait or Reject, got {answer!r}")

    def send(self, g: int, rec: Record, address: str) -> None:
        now = self.now
        rec.sent_s, rec.endpoint = now, address
        draft = self.drafts[rec.id]
        version = dict(draft.headers).get("model-version")
        if version is not None and self.routes.get(version.decode()) != self.node_cluster.get(address):
            rec.wrong_version = True
        if address not in self.present:
            self.close(rec, 503, "connect-failure" if address in self.handles else "bad-route")
            self.progress(g, Finished(rec.id, address, now, 503, None, 0.0, rec.prompt_tokens, 0, 0))
            return
        handle = self.handles[address]
        p = self.long_tail.get(address, 0.0)
        slowdown = LONG_TAIL_FACTOR if p and self.rng.random() < p else 1.0
        self.by_request[rec.id] = (address, g)
        keys = prompt_keys(draft.prompt, handle.block_size) if handle.kind == "llm" else None
        handle.engine.submit(EngineRequest(str(rec.id), draft.prompt.token_ids, draft.output_tokens, now,
                                           draft.memory_mib, slowdown, keys,
                                           draft.output_ids if handle.kind == "llm" else None), now)
        # visited now, not at its next event: a request it refuses at once (an OOM, too long a prompt)
        # is answered now, as the real server answers it, not when another request's step ends
        self.eng_next[address] = now
        heapq.heappush(self.eng_heap, (now, next(self.seq), address))
        self.drain_kv(address)

    def close(self, rec: Record, status: int, reason: str = "") -> None:
        """``rec`` got its answer (``status``) now."""
        rec.status = status
        rec.reason = reason
        rec.end_s = self.now
        if rec.measured:
            self.open_measured -= 1
        draft = self.drafts.pop(rec.id)
        if draft.next is not None and self.now + draft.next.think_s < self.spec.duration_s:
            self.push(self.now + draft.next.think_s, _FOLLOW, draft.next.draft)

    # --- the engines' events ------------------------------------------------------------------------

    def engine_events(self, address: str, events: Sequence[Any]) -> None:
        by_gateway: dict[int, list[Progress]] = {}
        records = self.records
        counters = self.counters[address]
        for ev in events:
            rid = int(ev.request_id)
            rec = records[rid]
            if isinstance(ev, EngineFirstToken):
                rec.first_s = ev.time_s
                rec.cached_tokens = ev.cached_tokens
                out: Progress = FirstToken(rid, address, ev.time_s, ev.cached_tokens)
            elif isinstance(ev, EngineFinished):
                assert rec.sent_s is not None
                rec.cached_tokens, rec.preemptions = ev.cached_tokens, ev.preemptions
                counters.finished(ev.time_s - rec.sent_s)
                self.by_request.pop(rid, None)
                self.close(rec, 200)
                out = Finished(rid, address, ev.time_s, 200, ev.first_token_s - rec.sent_s, ev.time_s - rec.sent_s,
                               ev.prompt_tokens, ev.output_tokens, ev.cached_tokens)
            elif isinstance(ev, Failed):
                assert rec.sent_s is not None
                counters.failed(ev.reason == FAIL_OOM)
                status = 500 if ev.reason == FAIL_OOM else 400
                self.by_request.pop(rid, None)
                self.close(rec, status, ev.reason)
                out = Finished(rid, address, ev.time_s, status, None, ev.time_s - rec.sent_s, rec.prompt_tokens, 0, 0)
            else:  # Tokens: no policy sees a per-token stream
                continue
            by_gateway.setdefault(rec.gateway, []).append(out)
        for g, batch in by_gateway.items():
            self.progress(g, *batch)
        self.drain_kv(address)

    def progress(self, g: int, *events: Progress) -> None:
        """Deliver progress of policy ``g``'s requests with its delay."""
        needs = self.policies[g].needs
        flush = needs.completion_flush_s
        if flush is None:
            return
        if flush == 0 and needs.completion_lag_s == 0:
            self.policies[g].on_progress(events)
            self.poll(g)
            return
        self.pending_progress[g].extend(events)
        if self.flush_at[g] is None:
            # never before now: ceil(now / flush) x flush can round below a now that is not on the grid
            tick = max(self.now, math.ceil(self.now / flush) * flush) if flush else self.now
            self.flush_at[g] = tick + needs.completion_lag_s
            self.push(self.flush_at[g], _FLUSH, g)

    def flush(self, g: int) -> None:
        batch, self.pending_progress[g] = self.pending_progress[g], []
        self.flush_at[g] = None
        if batch:
            self.policies[g].on_progress(batch)
            self.poll(g)

    def drain_kv(self, address: str) -> None:
        if not self.kv_wanted:
            return
        events = self.handles[address].engine.drain_kv_events()
        if not events:
            return
        batch = KvEvents(address, self.now, events)
        for g in self.kv_wanted:
            delay = self.policies[g].needs.kv_event_delay_s
            if delay:
                self.push(self.now + delay, _KV, (g, batch))
            else:
                self.policies[g].on_kv_events([batch])
                self.poll(g)

    # --- the policy's queue ---------------------------------------------------------------------------

    def poll(self, g: int) -> None:
        policy = self.policies[g]
        for request, answer in policy.poll():
            if isinstance(answer, Wait):
                raise TypeError(f"policy {self.name}: poll() answered Wait for request {request.id}")
            self.answer(g, request, answer)
        self.schedule_wake(g)

    def schedule_wake(self, g: int) -> None:
        """A wake-up for policy ``g`` at its :meth:`~bench.lab.policy.Policy.next_wake_s`; with several
        gateways, for every instance (one can change another's state through ``Context.shared``)."""
        for h in range(len(self.policies)) if len(self.policies) > 1 else (g,):
            t = self.policies[h].next_wake_s()
            if t is not None and (self.wake_at[h] is None or t < self.wake_at[h]):
                self.wake_at[h] = max(t, self.now)
                self.push(self.wake_at[h], _WAKE, h)

    # --- metrics ------------------------------------------------------------------------------------

    def scrape(self) -> None:
        stats = {a: self.handles[a].engine.stats() for a in self.addresses if a in self.present}  # node order
        self.slow.scrape(self.now, stats, self.counters)
        if self.spec.warmup_s <= self.now < self.spec.duration_s:
            self.result.waiting.extend(float(s.waiting) for s in stats.values())

    def policy_scrape(self, g: int) -> None:
        now = self.now
        samples = [Sample(a, now, sample_values(self.handles[a], self.handles[a].engine.stats()))
                   for a in self.addresses if a in self.present]
        self.policies[g].on_samples(samples)
        self.poll(g)
        interval = self.policies[g].needs.scrape_interval_s
        assert interval
        self.push(now + interval, _POLICY_SCRAPE, g)

    def counter_snapshot(self) -> dict[str, dict[str, float]]:
        out = {}
        for a, h in self.handles.items():
            s = h.engine.stats()
            out[a] = {"preemptions": s.preemptions, "prefix_queries": s.prefix_queries,
                      "prefix_hits": s.prefix_hits, "generation_tokens": s.generation_tokens}
        return out

    # --- faults -------------------------------------------------------------------------------------

    def _join(self, address: str) -> None:
        self.present.add(address)
        self.slow.join(address)

    def fault(self, fault: Fault) -> None:
        address = self.addresses[fault.node]
        if fault.kind == "add":
            self._join(address)
        elif fault.kind == "remove":
            self.present.discard(address)
            self.slow.leave(address)
            engine = self.handles[address].engine
            for rid, (where, g) in list(self.by_request.items()):
                if where == address:
                    engine.cancel(str(rid), self.now)
                    del self.by_request[rid]
                    rec = self.records[rid]
                    self.close(rec, 503, "endpoint-gone")
                    self.progress(g, Finished(rid, address, self.now, 503, None, self.now - (rec.sent_s or self.now),
                                              rec.prompt_tokens, 0, 0))
            self.rekey(address)
        elif fault.kind == "long_tail":
            self.long_tail[address] = fault.value
        elif fault.kind == "slow":
            self.handles[address].engine.set_slow_factor(fault.value, self.now)
            self.rekey(address)

    # --- the end ------------------------------------------------------------------------------------

    def finish(self) -> None:
        for p in self.policies:
            for request, answer in p.poll(final=True):
                if isinstance(answer, Reject):
                    self.close(self.records[request.id], answer.status, answer.reason)
        for rec in self.records:
            if rec.status is None:
                rec.reason = "unfinished" if rec.sent_s is not None else "held"
        self.result.counters_end = self.counter_snapshot()
        self.result.ended_s = self.now


def run(spec: RunSpec, make_policy: Callable[[], Policy]) -> RunResult:
    """Run ``spec`` with a fresh policy (``make_policy()`` per gateway) and return its records."""
    return _Run(spec, make_policy).execute()

