"""The lab's shared load view (bench.lab.loadview): the control plane's sum, the pickers' report loop,
memory grants and memory rounds in virtual time, the virtual event loop the request control's waits run on,
and a small multi-gateway lab run with and without the view."""

from __future__ import annotations

import asyncio

import pytest

from bench.lab.cluster import Cluster
from bench.lab.figures import point_figures
from bench.lab.harness import RunSpec, run
from bench.lab.loadview import ControlPlaneView, PickerLink
from bench.lab.policies.inferlb import Inferlb
from bench.lab.scenarios import QUICK, SCENARIOS
from bench.lab.virtual_loop import VirtualLoop
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.shared_load import Others, SharedLoad
from xds_server.loadview.rounds import FINISH_LAG_S

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pickers(n: int = 2, interval_s: float = 0.01, expiry_s: float = 1.0):
    clock = _Clock()
    plane = ControlPlaneView(expiry_s, clock)
    samples: dict[str, list[MemorySamples]] = {}
    viewed: dict[str, list[Others]] = {}  # picker -> the others' load before the views it missed, per turn
    links = []
    for i in range(n):
        name = f"gateway-{i}"
        shared = SharedLoad(InFlight(clock=clock))
        samples[name] = []
        viewed[name] = []
        links.append(PickerLink(name, shared, plane, interval_s, expiry_s, samples[name].append, viewed[name].append))
    for link in links:
        link.start()
    return clock, plane, links, samples, viewed


def test_each_picker_reads_the_others_load_from_the_control_planes_sum_less_its_own_share():
    clock, plane, (a, b), _, viewed = _pickers()
    a.shared.inflight.picked("c", E1, 1.5, 8192.0)
    a.shared.inflight.picked("c", E1, 1.0, 0.0)
    b.shared.inflight.picked("c", E1, 2.0, 0.0)
    b.shared.inflight.picked("c", E2, 1.0, 18432.0)
    # No picker has had traffic yet: each is alone in the view, so a change waits for the keep-alive (0.25 s).
    assert a.shared.alone() and b.shared.alone()
    clock.now = 0.01
    a.catch_up()
    b.catch_up()
    assert (a.reports, b.reports) == (1, 1)
    assert a.next_wake_s() == pytest.approx(0.01 * 2)  # changed: it wakes at each tick to check
    clock.now = 0.25
    a.catch_up()
    b.catch_up()
    assert (a.reports, b.reports) == (2, 2)
    totals = plane.table.totals(clock.now)
    assert totals.pickers == 2
    assert totals.endpoints[("c", E1)].in_flight == 3 and totals.endpoints[("c", E1)].work == pytest.approx(4.5)
    assert totals.clusters["c"].in_flight == 4
    # a's view came with b's report (pushed), b's with its own: each holds the other's load only.
    assert a.shared.others.work == {E1: 2.0, E2: 1.0} and a.shared.others.memory_mib == {E2: 18432.0}
    assert b.shared.others.work == {E1: 2.5} and b.shared.others.memory_mib == {E1: 8192.0}
    assert a.shared.work.get(E1) == pytest.approx(4.5) and b.shared.clusters.get("c") == 4
    assert not a.shared.alone() and not b.shared.alone()
    # Now a change is reported at the next tick (shared_view_interval_s after the last report), not before.
    b.shared.inflight.completed("c", E1)
    clock.now = 0.255
    a.catch_up()
    b.catch_up()
    assert b.reports == 2 and b.next_wake_s() == pytest.approx(0.26)
    assert a.viewed is None and viewed["gateway-0"][-1].work == {}, "told on its turn: before b's first view"
    clock.now = 0.26
    viewed["gateway-0"].clear()
    b.catch_up()
    assert b.reports == 3 and a.shared.others.work == {E2: 1.0}
    assert a.viewed is not None and a.viewed.work == {E1: 2.0, E2: 1.0}, "a view came in b's turn"
    a.catch_up()  # a's next turn: the picker is told what the others' load was before it
    assert a.viewed is None and [o.work for o in viewed["gateway-0"]] == [{E1: 2.0, E2: 1.0}]


def _busy(clock: _Clock, *links: PickerLink) -> None:
    """Each picker picks once and reports it at the keep-alive (0.25 s): from then on none is alone."""
    for link in links:
        link.shared.inflight.picked("c", E2, 1.0, 0.0)
    clock.now = 0.25
    for link in links:
        link.catch_up()
    assert not any(link.shared.alone() for link in links)


def test_the_ledger_refuses_a_room_another_pickers_unseen_grant_took():
    """Two pickers ask at the same moment: a's request is granted and committed (as the request control commits
    in the answer), and its pick goes out at once in a report of its own; b's request, asked on a view
    without it, is refused with a's unseen 18 GiB, and granted when asked again on the view that shows it."""
    clock, plane, (a, b), _, _ = _pickers()
    _busy(clock, a, b)
    clock.now = 0.3
    answers: list[tuple[str, int | None, float]] = []

    def commit(grant: int | None, unseen: float) -> None:
        answers.append(("a", grant, unseen))
        a.shared.inflight.picked("c", E1, 1.0, 18432.0)

    a.shared.grants.ask("c", E1, 18432.0, 6144.0, commit)
    b.shared.grants.ask("c", E1, 8192.0, 4096.0, lambda grant, unseen: answers.append(("b", grant, unseen)))
    reports = a.reports
    a.flush()  # the grant request at once, in its own report; then its granted pick, in the next
    assert answers == [("a", 1, 0.0)] and a.reports == reports + 2 and not a.shared.grants.granted
    assert b.shared.others.memory_mib.get(E1) == 18432.0, "b's view holds a's granted request already"
    b.flush()
    assert answers[1] == ("b", 0, 18432.0), "asked on a view without a's request: its grant takes b's room"
    assert b.shared.grants.held(E1) == 18432.0, "the refusal's note holds a's memory until the next view"
    b.shared.grants.ask("c", E1, 8192.0, 4096.0, lambda grant, unseen: answers.append(("b", grant, unseen)))
    b.flush()
    assert answers[2] == ("b", 2, 0.0), "b's view now holds a's request: the ledger no longer counts the grant"


def test_a_memory_round_reaches_each_picker_once_ready_with_the_others_share_as_its_baseline():
    clock, plane, (a, b), samples, _ = _pickers()
    a.shared.inflight.picked("c", E1, 1.0, 8192.0)
    _busy(clock, a, b)
    clock.now = 0.3
    plane.set_memory(0.3, {E1: (16384.0, 0.3), E2: (24576.0, 0.28)})
    plane.set_memory(0.3, {E1: (0.0, 0.3)})  # the same round from the next picker's call: kept once
    assert plane.memory_due("gateway-1") == pytest.approx(0.3 + FINISH_LAG_S)
    b.catch_up()
    assert samples["gateway-1"] == [], "not before the round's finished requests can all be reported"
    clock.now = 0.3 + FINISH_LAG_S
    a.catch_up()
    b.catch_up()
    got = samples["gateway-1"]
    assert len(got) == 1 and got[0].free == {E1: 16384.0, E2: 24576.0} and got[0].held is None
    assert got[0].taken_at == {E1: pytest.approx(0.3), E2: pytest.approx(0.28)}
    assert plane.memory_due("gateway-1") is None and len(samples["gateway-0"]) == 1
    b.shared.inflight.set_samples(got[0])
    # b's baseline: a's 8 GiB were in the sample; once a's request ends, b's estimate gets them back.
    assert b.shared.free.get(E1) == pytest.approx(16384.0)
    a.shared.inflight.completed("c", E1)
    clock.now += 0.01
    a.catch_up()
    assert b.shared.free.get(E1) == pytest.approx(24576.0)


def test_the_virtual_loop_runs_futures_and_timers_on_the_lab_clock():
    clock = _Clock()
    loop = VirtualLoop(clock)
    got: list[object] = []
    with loop.running():
        assert asyncio.get_running_loop() is loop and loop.time() == 0.0
        future = loop.create_future()
        future.add_done_callback(lambda f: got.append(f.result()))
        loop.call_later(0.05, future.set_result, "answered")
        loop.call_later(0.01, got.append, "cancelled").cancel()
        loop.call_later(0.1, lambda: 1 / 0)
    assert asyncio.events._get_running_loop() is None
    assert loop.next_timer_s() == pytest.approx(0.05)
    clock.now = 0.04
    loop.run_due()
    assert got == []
    clock.now = 0.05
    loop.run_due()
    assert got == ["answered"] and loop.next_timer_s() == pytest.approx(0.1)
    clock.now = 0.1
    with pytest.raises(ZeroDivisionError):  # raised to the lab, not logged and dropped
        loop.run_due()


def _oom(gateways: int, shared_view: bool = True, seed: int = 1) -> dict:
    sc = SCENARIOS["multi_gateway"]
    cluster = Cluster(sc.nodes(4), sc.engine, {} if shared_view else {"shared_view": False})
    spec = RunSpec(cluster, sc.workload(), 12.0, QUICK.duration_s, QUICK.warmup_s, QUICK.drain_s, seed,
                   gateways=gateways)
    return point_figures(run(spec, Inferlb))


def test_three_pickers_on_the_shared_view_keep_ooms_at_one_gateways_level_and_three_alone_do_not():
    one, shared, alone = _oom(1), _oom(3), _oom(3, shared_view=False)
    assert one["requests"] > 400 and shared["requests"] > 400
    assert shared["oom_rate"] <= one["oom_rate"] + 0.005
    assert alone["oom_rate"] >= 5 * max(one["oom_rate"], 0.005), (one["oom_rate"], alone["oom_rate"])
    assert _oom(3) == shared, "the same seed: the same figures"


def test_a_request_the_picker_commits_is_sent_at_that_moment_whatever_call_committed_it(monkeypatch):
    """A waiter released and granted while the picker decides a new request (the view that freed its room
    came in that call) is committed then, and the picker answers Envoy at once: the lab sends it at the
    same virtual moment, not at the picker's next wake-up (355 requests of the full multi_gateway run
    went 10 ms or more after their commit, their memory held on no GPU meanwhile)."""
    from bench.lab import harness
    from ext_proc.requestcontrol import RequestControl

    committed: dict[bytes, float] = {}
    late: list[float] = []
    commit, send = RequestControl.commit, harness._Run.send

    def _commit(self, decision, view, headers, phase):
        committed[headers["x-request-id"]] = self.inflight.now()
        return commit(self, decision, view, headers, phase)

    def _send(self, g, rec, address):
        at = committed.get(b"r%d" % rec.id)
        if at is not None and self.now > at + 1e-9:
            late.append(self.now - at)
        return send(self, g, rec, address)

    monkeypatch.setattr(RequestControl, "commit", _commit)
    monkeypatch.setattr(harness._Run, "send", _send)
    figures = _oom(3)
    assert figures["requests"] > 400 and len(committed) > 400
    assert late == []
