"""The shared load view on the control plane: the sum of every picker's report, expiry, bad input, and
the gRPC service answering each report and pushing it to the other pickers (a real grpc.aio server
on a loopback port)."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.load_client import view_samples
from protos import load_view_pb2, load_view_pb2_grpc
from tests.support.loadview import Context, counted, load_view_server, reports_from
from xds_server.loadview.exchange import report_from
from xds_server.loadview.rounds import FINISH_LAG_S, PICK_SLACK_S
from xds_server.loadview.service import LoadViewServicer
from xds_server.loadview.table import ClusterLoad, Load, LoadTable, Report

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def report(picker: str, seq: int, a: float = 0.0, b: float = 0.0, mib: float = 100.0) -> Report:
    endpoints = {("c", e): Load(n, n * 1.5, n * mib, n * 10, n) for e, n in ((A, a), (B, b)) if n}
    return Report(picker, seq, endpoints, {"c": ClusterLoad(a + b, 1.5 * (a + b))})


def test_the_view_is_the_sum_of_every_pickers_latest_report():
    t = LoadTable(expiry_s=1.0)
    t.record(report("p1", 1, a=2), now=10.0)
    t.record(report("p2", 1, a=1, b=3), now=10.0)
    t.record(report("p1", 2, a=4), now=10.05)  # replaces p1's first report, not added to it
    totals = t.totals(10.1)
    assert totals.pickers == 2
    assert totals.endpoints[("c", A)] == Load(5, 7.5, 500, 50, 5)
    assert totals.endpoints[("c", B)] == Load(3, 4.5, 300, 30, 3)
    assert totals.clusters["c"] == ClusterLoad(8, 12)


def test_a_picker_that_stops_reporting_stops_counting_after_the_expiry():
    t = LoadTable(expiry_s=1.0)
    t.record(report("dead", 1, a=5), now=10.0)
    t.record(report("alive", 1, a=1), now=10.0)
    t.record(report("alive", 2, a=1), now=10.8)
    assert t.totals(10.9).endpoints[("c", A)].in_flight == 6
    totals = t.totals(11.01)  # dead's last report is 1.01 s old
    assert totals.pickers == 1 and totals.endpoints[("c", A)].in_flight == 1
    assert t.report("dead") is None


def test_a_picker_without_picks_or_requests_in_flight_for_the_expiry_is_idle_to_the_others():
    t = LoadTable(expiry_s=1.0)
    t.record(report("busy", 1, a=2), now=10.0)
    t.record(report("idle", 1), now=10.0)  # no Envoy sends it traffic
    assert t.idle_others("busy", 10.1) == 1 and t.idle_others("idle", 10.1) == 0
    t.record(report("busy", 2), now=10.5)  # its requests ended: still busy within the expiry
    t.record(report("idle", 2), now=10.5)
    assert t.idle_others("idle", 10.9) == 0
    assert t.idle_others("idle", 11.6) == 1 and t.totals(11.4).pickers == 2
    t.record(report("idle", 3, b=1), now=11.7)  # it gets traffic
    assert t.idle_others("busy", 11.7) == 0
    t.forget("idle")
    assert t.idle_others("busy", 11.7) == 0


def test_a_forgotten_picker_leaves_the_sum_at_once_and_an_older_report_is_ignored():
    t = LoadTable(expiry_s=1.0)
    t.record(report("p1", 5, a=2), now=1.0)
    t.record(report("p1", 4, a=9), now=1.1)  # reordered: older seq
    assert t.totals(1.2).endpoints[("c", A)].in_flight == 2
    t.forget("p1")
    assert t.totals(1.2).pickers == 0 and not t.totals(1.2).endpoints


loads = st.floats(0, 1e6, allow_nan=False)


@given(st.lists(st.tuples(st.sampled_from(["p1", "p2", "p3"]), loads, loads, st.booleans()), max_size=30))
@settings(max_examples=80, deadline=None)
def test_the_running_sums_equal_the_plain_sum_of_the_kept_reports(steps):
    """Reports replace each other, pickers leave and come back: the incremental sums stay the sum."""
    t = LoadTable(expiry_s=100.0)
    latest: dict[str, Report] = {}
    for seq, (picker, a, b, leaves) in enumerate(steps):
        if leaves:
            t.forget(picker)
            latest.pop(picker, None)
        else:
            r = report(picker, seq, a, b)
            t.record(r, now=float(seq))
            latest[picker] = r
    totals = t.totals(float(len(steps)))
    assert totals.pickers == len(latest)
    for key in {k for r in latest.values() for k in r.endpoints} | set(totals.endpoints):
        want = sum(r.endpoints[key].work for r in latest.values() if key in r.endpoints)
        got = totals.endpoints[key].work if key in totals.endpoints else 0.0
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-3)
    want_c = sum(r.clusters["c"].in_flight for r in latest.values())
    got_c = totals.clusters["c"].in_flight if "c" in totals.clusters else 0.0
    assert math.isclose(got_c, want_c, rel_tol=1e-9, abs_tol=1e-3)


@pytest.mark.parametrize("bad, field", [
    (load_view_pb2.LoadReport(), "picker"),
    (load_view_pb2.LoadReport(picker="p", endpoints=[load_view_pb2.EndpointLoad(cluster="c", endpoint=A,
                                                                                 in_flight=-1)]), "in_flight"),
    (load_view_pb2.LoadReport(picker="p", endpoints=[load_view_pb2.EndpointLoad(cluster="c", endpoint=A,
                                                                                 work=math.nan)]), "work"),
    (load_view_pb2.LoadReport(picker="p", endpoints=[load_view_pb2.EndpointLoad(endpoint=A)]), "cluster"),
    (load_view_pb2.LoadReport(picker="p", clusters=[load_view_pb2.ClusterLoad(cluster="c", in_flight=math.inf)]),
     "in_flight"),
    (load_view_pb2.LoadReport(picker="p", finished=[load_view_pb2.FinishedRequests(memory_mib=[1.0],
                                                                                  picked_age_s=[0.1])]), "endpoint"),
    (load_view_pb2.LoadReport(picker="p", finished=[load_view_pb2.FinishedRequests(
        endpoint=A, memory_mib=[1.0, 2.0], picked_age_s=[0.1])]), r"finished\[.*2 memory_mib against 1 picked_age_s"),
    (load_view_pb2.LoadReport(picker="p", finished=[load_view_pb2.FinishedRequests(
        endpoint=A, memory_mib=[1.0, math.nan], picked_age_s=[0.1, 0.2])]), r"finished\[.*\]\.memory_mib .* nan"),
    (load_view_pb2.LoadReport(picker="p", finished=[load_view_pb2.FinishedRequests(
        endpoint=A, memory_mib=[1.0], picked_age_s=[-0.5])]), r"picked_age_s .* -0.5"),
])
def test_a_bad_report_is_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        report_from(bad)


def test_the_admin_document_gives_each_pickers_share():
    t = LoadTable(expiry_s=1.0)
    t.record(report("p1", 1, a=3), now=5.0)
    t.record(report("p2", 1, a=1), now=5.0)
    doc = t.shares(5.5)
    by = {p["picker"]: p for p in doc["pickers"]}
    assert by["p1"]["share"] == 0.75 and by["p2"]["share"] == 0.25
    assert by["p1"]["endpoints"][0]["share"] == 0.75 and by["p1"]["age_s"] == 0.5
    assert doc["endpoints"] == [{"cluster": "c", "endpoint": A, "in_flight": 4, "work": 6.0, "memory_mib": 400.0,
                                 "tokens": 40, "picks": 4}]


async def test_the_service_answers_each_report_and_pushes_the_sum_to_every_other_picker():
    table = LoadTable(expiry_s=5.0)
    async with load_view_server(table) as target, grpc.aio.insecure_channel(target) as channel:
        stub = load_view_pb2_grpc.LoadViewServiceStub(channel)
        one = stub.Share()
        await one.write(load_view_pb2.LoadReport(picker="p1", seq=1, endpoints=[
            load_view_pb2.EndpointLoad(cluster="c", endpoint=A, in_flight=2, work=2, memory_mib=50)]))
        v1 = await one.read()
        assert v1.pickers == 1 and v1.seq == 1 and v1.endpoints[0].in_flight == 2
        two = stub.Share()
        await two.write(load_view_pb2.LoadReport(picker="p2", seq=1, endpoints=[
            load_view_pb2.EndpointLoad(cluster="c", endpoint=A, in_flight=3, work=3)]))
        v2 = await two.read()
        assert v2.pickers == 2 and v2.endpoints[0].in_flight == 5
        assert [(e.endpoint, e.in_flight) for e in v2.own_endpoints] == [(A, 3)]
        pushed = await asyncio.wait_for(one.read(), 2)   # p1 learns of p2's report without reporting again
        assert pushed.pickers == 2 and pushed.endpoints[0].in_flight == 5 and pushed.seq == 1
        assert [(e.endpoint, e.in_flight) for e in pushed.own_endpoints] == [(A, 2)]
        await two.write(load_view_pb2.LoadReport(picker="", seq=2))  # refused, the stream goes on
        await two.write(load_view_pb2.LoadReport(picker="p2", seq=3))
        assert (await two.read()).seq == 3
        await one.done_writing()
        while (v := await one.read()) is not grpc.aio.EOF:   # views pushed by p2's reports, then the end
            assert v.pickers == 2
        v4 = await asyncio.wait_for(two.read(), 2)
        assert v4.pickers == 1, "p1's stream ended: it no longer counts, and p2 is told at once"
        await two.done_writing()


async def test_the_slow_loops_memory_samples_travel_with_the_view_once_per_round():
    table = LoadTable(expiry_s=5.0)
    async with load_view_server(table) as target, grpc.aio.insecure_channel(target) as channel:
        call = load_view_pb2_grpc.LoadViewServiceStub(channel).Share()
        await call.write(load_view_pb2.LoadReport(picker="p", seq=1))
        assert (await call.read()).memory_round == 0
        table.set_memory({A: (20480.0, time.monotonic() - 0.5)})
        await call.write(load_view_pb2.LoadReport(picker="p", seq=2))
        view = await call.read()   # at once, the round's part in the view after it (built off the loop)
        if not view.memory_round:
            view = await call.read()
        assert view.memory_round == 1
        [(endpoint, (free, taken))] = view_samples(view, now=100.0).items()
        assert endpoint == A and free == 20480.0 and 99.0 < taken <= 99.5  # 0.5 s old (and the send)
        await call.write(load_view_pb2.LoadReport(picker="p", seq=3))
        again = await call.read()
        assert again.memory_round == 0 and not again.memory, "the same round is not sent twice"
        await call.done_writing()


async def test_a_samples_age_counts_until_the_view_goes_out_not_until_its_samples_were_told():
    """The samples are told off the event loop, the view goes out later: ``age_s + memory_age_s`` is
    the sample's age when the view was sent (a younger-looking sample would let the picker take the
    picks just before it as in it)."""
    ticks = iter(range(10_000))

    def clock() -> float:
        return 10.0 + 0.25 * next(ticks)   # every read of the clock a quarter second later

    table = LoadTable(expiry_s=1000.0)
    table.set_memory({A: (20480.0, 9.0)})
    servicer = LoadViewServicer(table, clock=clock)
    reports: asyncio.Queue = asyncio.Queue()
    reports.put_nowait(load_view_pb2.LoadReport(picker="p", seq=1))
    views = servicer.Share(reports_from(reports), Context())
    view = await anext(views)   # at once, the round's part in the view after it (built off the loop)
    if not view.memory_round:
        view = await anext(views)
    sent = clock() - 0.25   # the servicer's last read
    await views.aclose()
    assert view.memory_round == 1 and view.memory_age_s > 0.0
    assert view.memory[0].age_s + view.memory_age_s == pytest.approx(sent - 9.0)
    [(_, (_, taken))] = view_samples(view, now=sent).items()
    assert taken == pytest.approx(9.0)


def _walked_held(history, endpoint: str, before: float, after: float) -> float:
    """One picker's share by walking its reports one by one (how it was counted per endpoint and per
    view before the round's counts were shared): the reference for the indexed count."""
    base, value = history[0][0], history[0][1].get(endpoint, 0.0)
    for received, mib, finished in history:
        if received > after:
            break
        if received <= before:
            base, value = received, mib.get(endpoint, 0.0)
        elif received > base:
            value -= sum(m for e, picked_at, m in finished if e == endpoint and picked_at <= base)
    return max(0.0, value)


_EPS = ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.floats(0, 0.2),
                          st.dictionaries(st.sampled_from(_EPS), st.sampled_from((0.0, 2048.0, 8192.0)), max_size=3),
                          st.lists(st.tuples(st.sampled_from(_EPS), st.floats(0, 2), st.sampled_from((2048.0, 8192.0))),
                                   max_size=3)), max_size=40),
       st.dictionaries(st.sampled_from(_EPS), st.floats(0, 6), min_size=1))
def test_a_rounds_baselines_and_capacities_count_what_the_walk_over_each_report_counts(reports, sampled):
    """The round's counts (one indexed pass per picker, every view taking the sum less its own share)
    against walking each other picker's reports for each endpoint and each view (within HISTORY_S:
    the round counts only endpoints with memory reported in it)."""
    t = LoadTable(expiry_s=100.0)
    now, seqs = 0.0, {}
    for picker, step, held, finished in reports:
        now += step
        seqs[picker] = seqs.get(picker, 0) + 1
        t.record(Report(picker, seqs[picker], endpoints={("c", e): Load(1, 1, mib) for e, mib in held.items()},
                        finished=tuple(finished)), now)
    t.set_memory({e: (10000.0, at) for e, at in sampled.items()})
    histories = dict(t._mib)
    counts = counted(t)
    caps = counts.capacities
    for endpoint, at in sampled.items():
        for picker in (None, "a", "b", "c"):
            walked = sum(_walked_held(h, endpoint, at - PICK_SLACK_S, at + FINISH_LAG_S)
                         for name, h in histories.items() if name != picker)
            assert counts.others(picker).get(endpoint, 0.0) == pytest.approx(walked, abs=1e-6)
        if endpoint in caps:
            every = sum(_walked_held(h, endpoint, at, at + FINISH_LAG_S) for h in histories.values())
            assert caps[endpoint] == pytest.approx(10000.0 + every, abs=1e-6)
