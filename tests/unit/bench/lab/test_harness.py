"""The lab's harness on the real engines: determinism, information delays, faults, sessions, KV events."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import astuple, replace

import pytest

from bench.lab.cluster import Cluster, Node
from bench.lab.figures import point_figures, sessions_moved
from bench.lab.harness import Fault, Record, RunResult, RunSpec, run
from bench.lab.policies.dynamo import DynamoKv
from bench.lab.policies.inferlb import Inferlb
from bench.lab.policies.oracle import Oracle
from bench.lab.policies.round_robin import RoundRobin
from bench.lab.policy import Answer, Finished, Needs, PolicyBase, Progress, Prompt, Reject, Request, Route, Wait
from bench.lab.runner import Point, lab_document, plan, run_point, run_points
from bench.lab.scenarios import FULL, QUICK, Mode
from bench.lab.workloads.base import Draft, FollowUp, Sizing
from bench.lab.workloads.sessions import ChatSessions
from bench.lab.workloads.shared_prefix import SharedPrefix
from bench.lab.workloads.tokens import Synth


def _cluster(n: int = 2, **kw) -> Cluster:
    return Cluster(tuple(Node(**kw) for _ in range(n)))


def test_a_small_lab_gives_identical_json_twice() -> None:
    mode = Mode(engines=2, duration_s=20.0, warmup_s=4.0, drain_s=20.0)
    points = [Point("shared_prefix", p, 3.0, mode, 2, 5) for p in ("llm_d", "dynamo_kv", "inferlb", "oracle")]
    docs = []
    for _ in range(2):
        results = [run_point(p) for p in points]
        for r in results:
            del r["cpu_s"]  # the only figure that is a measurement of this machine
        docs.append(json.dumps(lab_document(points, results, seed=5, commit="x", command="c", date="d"),
                               sort_keys=True))
    assert docs[0] == docs[1]
    doc = json.loads(docs[0])
    llm_d = doc["scenarios"]["shared_prefix"]["policies"]["llm_d"]["points"][0]
    assert llm_d["requests"] > 30 and llm_d["error_rate"] == 0.0 and llm_d["ttft_p90_ms"] > 0


class _Recorder(PolicyBase):
    """Round robin over the healthy endpoints that records when it learns of each completion."""

    name = "recorder"

    def __init__(self, flush: float | None = 0.0) -> None:
        super().__init__()
        self.needs = Needs(completion_flush_s=flush)
        self.learned: list[tuple[float, Finished]] = []
        self.n = 0

    def decide(self, request: Request) -> Answer:
        assert self.eds is not None
        eps = self.eds.healthy("chat-v1")
        if not eps:
            return Reject(503, "none")
        self.n += 1
        return Route(eps[self.n % len(eps)].address)

    def on_progress(self, events: Sequence[Progress]) -> None:
        assert self.ctx is not None
        self.learned += [(self.ctx.clock(), e) for e in events if isinstance(e, Finished)]


def test_completions_reach_a_proxy_at_once_and_an_access_log_reader_at_its_flushes() -> None:
    spec = RunSpec(_cluster(), SharedPrefix(groups=2), 2.0, 20.0, drain_s=30.0)
    proxy, picker = _Recorder(0.0), _Recorder(0.5)
    run(spec, lambda: proxy)
    run(spec, lambda: picker)
    assert proxy.learned and all(at == e.at_s for at, e in proxy.learned)
    assert picker.learned
    for at, e in picker.learned:
        assert at >= e.at_s and at - e.at_s < 0.5 + 1e-9
        assert abs(at / 0.5 - round(at / 0.5)) < 1e-9  # delivered on a flush tick


def test_a_node_that_joins_gets_traffic_once_healthy_and_one_that_leaves_fails_its_requests() -> None:
    nodes = (Node(), Node(), Node(present=False))
    spec = RunSpec(Cluster(nodes), ChatSessions(anon_share=1.0, output_tokens=400), 6.0, 120.0, drain_s=30.0,
                   faults=(Fault(30.0, "add", 2), Fault(80.0, "remove", 0)))
    result = run(spec, RoundRobin)
    joiner, leaver = Cluster.address(2), Cluster.address(0)
    to_joiner = [r for r in result.records if r.endpoint == joiner]
    assert to_joiner and min(r.sent_s for r in to_joiner) >= 30.0  # never before it joined
    gone = [r for r in result.records if r.reason == "endpoint-gone"]
    assert gone and all(r.endpoint == leaver and r.sent_s < 80.0 for r in gone)  # its requests in flight at 80 s
    # after the removal, requests sent to it (before the next round) fail to connect; none after that round
    late = [r for r in result.records if r.endpoint == leaver and r.sent_s is not None and r.sent_s >= 80.0]
    assert all(r.reason == "connect-failure" for r in late)
    assert all(r.sent_s < 80.0 + spec.timing.interval_s for r in late)


def test_a_session_turn_comes_think_time_after_the_previous_one_ended() -> None:
    synth = Synth(1)

    class TwoTurns:
        name = "two_turns"

        def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random):
            second = Draft(Prompt((synth.message("user", 40),)), 8, 8, session=1)
            first = Draft(second.prompt, 200, 200, session=1, next=FollowUp(3.0, lambda: second))
            yield 1.0, first

    result = run(RunSpec(_cluster(1), TwoTurns(), 1.0, 60.0), RoundRobin)
    a, b = result.records
    assert a.status == b.status == 200
    assert b.arrival_s == a.end_s + 3.0
    assert b.cached_tokens > 0  # the same prompt again: its blocks are still cached


class _RejectFirst(RoundRobin):
    """Round robin that rejects the run's first request (a policy's 429)."""

    name = "reject_first"

    def decide(self, request: Request) -> Answer:
        return Reject(429, "queue-timeout") if request.id == 0 else super().decide(request)


@pytest.mark.parametrize("failure", ["oom", "queue-timeout"])
def test_a_session_goes_on_after_a_failed_turn_with_the_same_prompts(failure: str) -> None:
    # the real path's open-loop trace sends every turn whatever the earlier ones got: so does the lab
    synth = Synth(1)
    question, reply, again = (synth.message(role, 40) for role in ("user", "assistant", "user"))

    class ThreeTurns:
        name = "three_turns"

        def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random):
            third = Draft(Prompt((question, reply, again, reply, again)), 8, 8, memory_mib=1000.0, session=1)
            second = Draft(Prompt((question, reply, again)), 8, 8, memory_mib=1000.0, session=1,
                           next=FollowUp(2.0, lambda: third))
            first = Draft(Prompt((question,)), 8, 8, memory_mib=30_000.0 if failure == "oom" else 1000.0,
                          session=1, next=FollowUp(3.0, lambda: second))
            yield 1.0, first

    policy = RoundRobin if failure == "oom" else _RejectFirst
    result = run(RunSpec(_cluster(1, kind="job", gpu_memory_mib=24_000.0), ThreeTurns(), 1.0, 60.0), policy)
    a, b, c = result.records
    assert a.reason == failure and a.status in (429, 500)
    assert a.end_s == a.arrival_s == 1.0  # refused at once, answered at once (not at the engine's next event)
    assert b.status == c.status == 200
    assert b.arrival_s == a.end_s + 3.0 and c.arrival_s == b.end_s + 2.0
    assert (b.prompt_tokens, c.prompt_tokens) == (120, 200)  # the failed turn's reply is in the history


class _Holder(PolicyBase):
    """Holds every request, answers them all 0.5 s later (a policy's queue)."""

    name = "holder"

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Request] = []

    def decide(self, request: Request) -> Answer:
        self.held.append(request)
        return Wait()

    def poll(self, final: bool = False):
        assert self.ctx is not None and self.eds is not None
        now = self.ctx.clock()
        ready = [r for r in self.held if r.arrival_s + 0.5 <= now]
        self.held = [r for r in self.held if r.arrival_s + 0.5 > now]
        return [(r, Route(self.eds.healthy("chat-v1")[0].address)) for r in ready]

    def next_wake_s(self):
        return min((r.arrival_s + 0.5 for r in self.held), default=None)


def test_a_held_request_is_sent_when_the_policy_wakes_and_its_wait_counts_in_ttft() -> None:
    result = run(RunSpec(_cluster(1), SharedPrefix(groups=1), 1.0, 20.0, drain_s=30.0), _Holder)
    sent = [r for r in result.records if r.status == 200]
    assert sent and all(abs(r.sent_s - (r.arrival_s + 0.5)) < 1e-9 for r in sent)
    assert all(r.first_s - r.arrival_s > 0.5 for r in sent)


def test_dynamo_learns_cached_blocks_from_kv_events_and_keeps_a_prefix_where_it_is() -> None:
    policy = DynamoKv()
    # one request at a time (50 output tokens, one arrival per 5 s): the worker holding the blocks costs
    # 450 decode blocks against another's 450 prefill + 450 decode blocks
    result = run(RunSpec(_cluster(4), SharedPrefix(groups=1, users=1, output_tokens=50), 0.2, 60.0, drain_s=30.0),
                 lambda: policy)
    assert any(policy.index.cached.values())
    served = {r.endpoint for r in result.records[3:]}  # after the first has stored its blocks
    assert len(served) == 1
    assert point_figures(result)["prefix_hit_rate"] > 0.8


def test_the_oracle_and_inferlb_keep_a_shared_prefix_on_one_engine_at_low_load() -> None:
    for make in (Oracle, Inferlb):
        result = run(RunSpec(_cluster(4), SharedPrefix(groups=1, users=1, output_tokens=50), 0.2, 60.0, drain_s=30.0),
                     make)
        assert len({r.endpoint for r in result.records[3:]}) == 1, make.name
        assert point_figures(result)["prefix_hit_rate"] > 0.8, make.name


def test_inferlb_pins_a_session_and_learns_completions_from_the_access_log() -> None:
    policy = Inferlb()
    spec = RunSpec(_cluster(4), ChatSessions(turns=(5, 5), think_s=0.5, output_tokens=32, system_tokens=0,
                                             tenants=0), 2.0, 30.0, drain_s=30.0)
    result = run(spec, lambda: policy)
    by_session: dict[int, set[str]] = {}
    for r in result.records:
        if r.session is not None and r.endpoint is not None:
            by_session.setdefault(r.session, set()).add(r.endpoint)
    assert by_session and all(len(eps) == 1 for eps in by_session.values())
    handler = policy.handler
    assert handler is not None
    # every completion but those of the last flush reached the picker's cost model through the access log
    finished = sum(1 for r in result.records if r.status == 200)
    observed = sum(s.n for s in handler.control.costs._sums.values())
    assert finished - 3 <= observed <= finished
    assert sum(handler.control.inflight.endpoints.values()) <= 3


def test_quick_mode_is_a_small_cluster_and_a_minute() -> None:
    assert (QUICK.engines, QUICK.duration_s) == (4, 60.0)


def test_a_scenario_runs_its_published_cluster_size_in_the_full_lab_only() -> None:
    """sharegpt_chat runs KubeAI's 8 L4s in the full lab (6-12 QPS per engine: 48-96 QPS); ``--quick``
    keeps its 4 engines and ``--engines`` overrides both; other scenarios keep the lab's 16."""
    full = plan(["sharegpt_chat", "uniform"], ["inferlb"], False, None, 1)
    assert {(p.scenario, p.engines) for p in full} == {("sharegpt_chat", 8), ("uniform", 16)}
    assert [p.qps for p in full if p.scenario == "sharegpt_chat"] == [48.0, 64.0, 80.0, 96.0]
    assert {p.engines for p in plan(["sharegpt_chat"], ["inferlb"], True, None, 1)} == {4}
    assert {p.engines for p in plan(["sharegpt_chat"], ["inferlb"], False, 12, 1)} == {12}


def test_a_scenario_of_its_own_length_runs_it_in_the_full_lab_only() -> None:
    """heterogeneous sweeps to 20 QPS per engine on two minutes of arrivals per point (warm-up and drain
    in proportion, as ``--duration`` gives them); ``--quick`` and ``--duration`` set its length as any
    other scenario's; uniform keeps the lab's ten minutes."""
    full = plan(["heterogeneous", "uniform"], ["inferlb"], False, None, 1)
    spans = {(p.scenario, p.mode.duration_s, p.mode.warmup_s, p.mode.drain_s) for p in full}
    assert spans == {("heterogeneous", 120.0, 12.0, 24.0), ("uniform", *astuple(FULL)[1:])}
    assert [p.qps for p in full if p.scenario == "heterogeneous"] == [64.0, 304.0, 320.0]
    assert {p.mode for p in plan(["heterogeneous"], ["inferlb"], True, None, 1)} == {QUICK}
    assert {p.mode.duration_s for p in plan(["heterogeneous"], ["inferlb"], False, None, 1, duration_s=300.0)} \
        == {300.0}


def test_the_figures_do_not_depend_on_the_process_string_hashing() -> None:
    """Same seed, another process with another PYTHONHASHSEED: the same JSON (no set or str-hash order leaks in),
    also with three gateways on the shared load view (the control plane's sums and memory rounds)."""
    import os
    import subprocess
    import sys

    code = ("import json; from bench.lab.runner import Point, run_point; from bench.lab.scenarios import Mode; "
            "m = Mode(engines=2, duration_s=20.0, warmup_s=4.0, drain_s=20.0); "
            "f = [run_point(Point(s, 'inferlb', 6.0, m, 2, 3)) for s in ('sessions', 'multi_gateway')]; "
            "[x.pop('cpu_s') for x in f]; print(json.dumps(f, sort_keys=True))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "4242")}
    assert len(outs) == 1
    sessions, gateways = json.loads(outs.pop())
    assert sessions["requests"] > 20 and gateways["requests"] > 20


def test_runs_start_longest_first_and_come_back_in_the_plan_order() -> None:
    """The run with the most offered requests starts first (so --jobs workers finish together); the
    figures come back in the plan's order, the same with one worker or two."""
    mode = Mode(engines=2, duration_s=6.0, warmup_s=1.0, drain_s=10.0)
    points = [Point("uniform", "round_robin", qps, mode, 2, 1) for qps in (2.0, 8.0, 4.0)]
    started: list[float] = []
    one = run_points(points, 1, lambda i, p, f: started.append(p.qps))
    assert started == [8.0, 4.0, 2.0]
    assert [f["qps"] for f in one] == [2.0, 8.0, 4.0]
    two = run_points(points, 2)
    assert [{k: v for k, v in f.items() if k != "cpu_s"} for f in two] == \
        [{k: v for k, v in f.items() if k != "cpu_s"} for f in one]


def test_sessions_moved_counts_sessions_whose_last_endpoint_changed_across_the_first_add() -> None:
    def rec(i: int, at: float, session: int | None, endpoint: str, status: int | None = 200) -> Record:
        return Record(i, at, True, session, 0, 100, 10, endpoint=endpoint, status=status)

    records = [
        rec(0, 1.0, 1, "a"), rec(1, 6.0, 1, "a"),             # stays
        rec(2, 1.0, 2, "a"), rec(3, 2.0, 2, "b"), rec(4, 7.0, 2, "c"),   # last before b, after c: moved
        rec(5, 1.0, 3, "b"), rec(6, 6.0, 3, "c", status=500),  # its answer after failed: not on both sides
        rec(7, 6.0, 4, "c"),                                    # a new session: not on both sides
        rec(8, 1.0, 5, "a"), rec(9, 12.0, 5, "b"),              # after the next fault: not counted
        rec(10, 1.0, None, "a"), rec(11, 6.0, None, "b"),       # no session
    ]
    spec = RunSpec(cluster=None, workload=None, qps=1.0, duration_s=20.0,  # type: ignore[arg-type]
                   faults=(Fault(10.0, "remove", 1), Fault(5.0, "add", 3)))
    assert sessions_moved(RunResult(spec, "p", records)) == 0.5
    assert sessions_moved(RunResult(replace(spec, faults=(Fault(5.0, "remove", 1),)), "p", records)) is None
