"""The load view's memory rounds, counted off the event loop (xds_server/loadview/rounds.py,
LoadViewServicer.Share): capacity rounds kept through a missing sample, no round counted before it is
ready, and views (with their grant answers) that do not wait for a round's count."""

from __future__ import annotations

import asyncio
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from protos import load_view_pb2
from tests.support.loadview import Context, counted, reports_from
from xds_server.loadview.exchange import memory_message
from xds_server.loadview.rounds import CAPACITY_ROUNDS, maybe_held
from xds_server.loadview.service import LoadViewServicer
from xds_server.loadview.table import Load, LoadTable, Report

A = "10.0.0.1:8000"


def test_a_round_without_an_endpoints_sample_keeps_its_capacity_rounds():
    """The capacity is the median of the last CAPACITY_ROUNDS rounds, so one wrong round does not move
    it. An endpoint that is still active (memory reported) but missing from one round's samples (its
    metrics missing that round) kept its rounds in the old ``LoadTable.capacities``; count_round forgot
    them, and the next round's single (wrong) value became the capacity."""
    t = LoadTable(expiry_s=1000.0)
    now = 0.0
    for i in range(CAPACITY_ROUNDS):
        now += 1.0
        t.record(Report("p", 2 * i + 1, endpoints={("c", A): Load(1, 1, 2048.0)}), now)
        t.set_memory({A: (8192.0, now + 0.2)})   # 8192 free + 2048 held: capacity 10240
        counted(t)
    assert counted(t).capacities[A] == 10240.0
    now += 1.0
    t.record(Report("p", 100, endpoints={("c", A): Load(1, 1, 2048.0)}), now)
    t.set_memory({"10.0.0.9:8000": (1.0, now)})   # A's sample missing this round; A is still active
    counted(t)
    now += 1.0
    t.record(Report("p", 101, endpoints={("c", A): Load(1, 1, 2048.0)}), now)
    t.set_memory({A: (20000.0, now + 0.2)})        # one wrong round (e.g. a request not reported yet)
    assert counted(t).capacities[A] == 10240.0, "one wrong round must not move the median"


async def test_a_round_that_comes_while_one_is_counted_is_not_counted_before_it_is_ready():
    """Round 1 is ready and being counted; round 2 comes (its sample at 10.0, ready at 10.1) before the
    count ends. ``_round_counts`` went on to count round 2 at once (clock 10.0), before the other
    picker's report of a request that finished just before the sample came in (10.05): round 2's
    baseline then held that request (others_mib 2048), and the picker credited it twice."""
    now = [10.0]

    reports: asyncio.Queue = asyncio.Queue()
    table = LoadTable(expiry_s=1000.0)
    table.record(Report("q", 1, endpoints={("c", A): Load(1, 1, 2048.0)}), 9.9)   # q's request on A
    table.set_memory({A: (18432.0, 9.0)})   # round 1, ready at 9.1
    servicer = LoadViewServicer(table, clock=lambda: now[0])
    gate = threading.Event()
    servicer._worker.submit(gate.wait)       # the worker is busy: round 1's count waits
    views = servicer.Share(reports_from(reports), Context())
    try:
        await reports.put(load_view_pb2.LoadReport(picker="p", seq=1))
        got = [await asyncio.wait_for(anext(views), 5)]
        await asyncio.sleep(0.05)            # round 1's count waits for the worker
        table.set_memory({A: (20480.0, 10.0)})   # round 2: q's request had ended by 10.0 (free in it)
        gate.set()
        while not any(v.memory_round for v in got):
            got.append(await asyncio.wait_for(anext(views), 5))
        now[0] = 10.05                       # q reports its request finished (picked at 9.85)
        table.record(Report("q", 2, finished=((A, 0.2, 2048.0),)), 10.05)
        now[0] = 10.2                        # round 2 is ready
        await reports.put(load_view_pb2.LoadReport(picker="p", seq=2))
        while not any(v.memory_round == 2 for v in got):
            got.append(await asyncio.wait_for(anext(views), 5))
    finally:
        await views.aclose()
    [round_2] = [v for v in got if v.memory_round == 2]
    assert round_2.memory[0].others_mib == 0.0, "q's finished request is free in the sample: not held"


async def test_a_grant_request_is_answered_while_a_round_is_counted():
    """Every view to a stream waited for the round's count and its memory part (~0.1 s at 10 000
    endpoints, ~0.6 s at 60 000: BENCHMARKS.md, "Load view"), and with it the answers to the picker's grant
    requests, which it waits for only GRANT_TIMEOUT_S (50 ms) or its queue timeout: every admission in
    that window was decided locally, or refused with the memory queue. The view need not wait: the
    round's part can go in a later one."""
    reports: asyncio.Queue = asyncio.Queue()
    table = LoadTable(expiry_s=1000.0)
    servicer = LoadViewServicer(table, clock=lambda: 10.0)
    gate = threading.Event()
    views = servicer.Share(reports_from(reports), Context())
    try:
        await reports.put(load_view_pb2.LoadReport(picker="p", seq=1))
        assert (await asyncio.wait_for(anext(views), 5)).memory_round == 0
        servicer._worker.submit(gate.wait)   # the worker is busy: the round's count waits
        table.set_memory({A: (20480.0, 9.0)})
        await reports.put(load_view_pb2.LoadReport(picker="p", seq=2, grant_requests=[
            load_view_pb2.GrantRequest(id=7, cluster="c", endpoint=A, memory_mib=100.0, room_mib=1000.0)]))
        got = []
        async with asyncio.timeout(1.0):
            while not any(v.grants for v in got):
                got.append(await anext(views))
        assert [a.id for v in got for a in v.grants] == [7]
        gate.set()
        while not any(v.memory_round == 1 for v in got):   # the round follows once counted
            got.append(await asyncio.wait_for(anext(views), 5))
    finally:
        gate.set()
        await views.aclose()


def _record_requests(t: LoadTable, picker: str, requests: list[tuple[float, float]], reports: list[float]) -> None:
    """Reports of ``picker`` at the times ``reports`` (sorted), as its picker builds them, for its
    requests ``[(picked at, ended at)]`` on A: in flight (picked before the report, not ended by it),
    picks since the report before (a pick at that report's very time may have come after it was
    built: counted as after), and the requests ended since the report before with their pick times."""
    before = -1.0
    for seq, at in enumerate(reports, 1):
        in_flight = [p for p, e in requests if p < at < e]
        picks = sum(1 for p in in_flight if p >= before)
        ended = tuple((A, at - p, 1.0) for p, e in requests if before < e <= at)
        t.record(Report(picker, seq, endpoints={("c", A): Load(len(in_flight), 0.0, 1.0 * len(in_flight), 0.0, picks)},
                        finished=ended), at)
        before = at


_GRID = st.integers(0, 40).map(lambda i: i / 20)   # times on a 50 ms grid: ties with reports and the sample


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_GRID, st.integers(1, 20).map(lambda i: i / 20)), max_size=12),
       st.lists(_GRID, min_size=1, max_size=10, unique=True), _GRID)
def test_maybe_held_is_never_below_the_requests_the_sample_holds(requests, reports, taken):
    """Whatever the pick and end times against the reports (ties included), the requests of a picker a
    sample may hold are at least those it holds (picked by its time, not ended), once the picker's
    first report after the sample is in: an under-count would let the picker's share of the held count
    credit a doubtful request the GPU still holds (its estimate one request high)."""
    spans = [(p, p + d) for p, d in requests]
    last = max([taken, *reports, *(e for _, e in spans)]) + 0.05
    t = LoadTable(expiry_s=1000.0)
    _record_requests(t, "p", spans, sorted([*reports, last]))
    holds = sum(1 for p, e in spans if p <= taken < e)
    assert maybe_held(dict(t._mib), {A: (0.0, taken)}).get("p", {}).get(A, 0.0) >= holds


def test_each_picker_gets_the_held_count_less_what_the_others_may_hold():
    """The backend held 4 requests; the other picker had 1 in flight in its report before the sample
    and 1 picked after that report and by the sample's time (reported finished after it): this one's
    share is 4 - 2 = 2, carried by its memory samples (``MemorySample.held``); without held counts
    the field is absent."""
    t = LoadTable(expiry_s=1000.0)
    t.record(Report("q", 1, endpoints={("c", A): Load(1, 1, 8192.0, 0.0, 1)}), 1.0)
    t.record(Report("p", 1, endpoints={("c", A): Load(2, 2, 16384.0, 0.0, 2)}), 1.0)
    t.record(Report("q", 2, endpoints={("c", A): Load(1, 1, 8192.0, 0.0, 0)},
                    finished=((A, 0.5, 8192.0),)), 2.0)   # picked at 1.5, reported finished at 2.0
    t.set_memory({A: (0.0, 1.6)}, held={A: 4.0})
    counts = counted(t)
    assert counts.maybe["q"][A] == 2.0 and counts.own_held("p") == {A: 2.0}
    [sample] = memory_message(counts, "p", 2.0).memory
    assert sample.HasField("held") and sample.held == 2.0
    t.set_memory({A: (0.0, 1.6)})
    [sample] = memory_message(counted(t), "p", 2.0).memory
    assert not sample.HasField("held")


def _record_sized(t: LoadTable, picker: str, requests: list[tuple[float, float, float]], reports: list[float]) -> None:
    """As :func:`_record_requests`, for requests ``[(picked at, ended at, MiB)]`` of any size on A."""
    before = -1.0
    for seq, at in enumerate(reports, 1):
        in_flight = [(p, m) for p, e, m in requests if p < at < e]
        picks = sum(1 for p, _ in in_flight if p >= before)
        ended = tuple((A, at - p, m) for p, e, m in requests if before < e <= at)
        t.record(Report(picker, seq, endpoints={("c", A): Load(len(in_flight), 0.0, sum(m for _, m in in_flight),
                                                               0.0, picks)}, finished=ended), at)
        before = at


def _two_pickers(q_requests: list[tuple[float, float, float]], p_requests: list[tuple[float, float, float]] = (),
                 taken: float = 1.0, held: float | None = None) -> tuple[LoadTable, float]:
    """p and q reporting every 10 ms from 0 to 1.2 s; a sample of A at ``taken`` with the backend's count
    ``held`` (None: the requests it truly holds)."""
    t = LoadTable(expiry_s=1000.0)
    ticks = [i / 100 for i in range(121)]
    _record_sized(t, "q", q_requests, ticks)
    _record_sized(t, "p", list(p_requests), ticks)
    truth = sum(1 for p, e, _ in [*q_requests, *p_requests] if p <= taken < e)
    t.set_memory({A: (0.0, taken)}, held={A: truth if held is None else held})
    return t, truth


def test_the_count_settles_another_pickers_request_picked_just_before_the_sample():
    """q's 8 GiB request was picked 25 ms before the sample: the baseline leaves it out (it may not have
    reached the GPU). The backend's count says one request was held and p had none there, so it was
    q's: p's baseline (``others_mib``) counts it, and p credits it when it ends, as one gateway does.
    Still in flight, its size is its report's (the one pick there since the report before). With a count
    of 0 it was not in the sample: not counted."""
    q = [(0.975, 1.3, 8192.0)]
    t, _ = _two_pickers(q)
    counts = counted(t)
    assert counts.shares.get("q", {}).get(A, 0.0) == 0.0       # the baseline's certain part: none
    assert counts.settled["p"] == {A: 8192.0} and counts.others("p")[A] == 8192.0
    t, _ = _two_pickers(q, held=0.0)
    assert counted(t).others("p").get(A, 0.0) == 0.0


def test_the_count_settles_another_pickers_request_reported_finished_just_after_the_sample():
    """q's 18 GiB request ended 40 ms after the sample: reported within the lag, the baseline leaves it
    out (it may have ended before the sample). Held by the count: p's baseline counts it, its own size."""
    t, _ = _two_pickers([(0.5, 1.04, 18432.0)])
    counts = counted(t)
    assert counts.settled["p"] == {A: 18432.0} and counts.others("p")[A] == 18432.0


def test_the_smallest_doubtful_requests_count_first_and_the_pickers_own_doubt_counts_against():
    """Two doubtful requests of q (8 and 18 GiB, one picked just before the sample, one ended just after),
    one held by the count: 8 GiB counts (the sum errs low). When p also has a doubtful request the
    one held may be p's: nothing counts for p."""
    q = [(0.98, 1.3, 18432.0), (0.5, 1.03, 8192.0)]
    t, _ = _two_pickers(q, held=1.0)
    assert counted(t).settled["p"] == {A: 8192.0}
    t, _ = _two_pickers(q, [(0.99, 1.3, 8192.0)], held=1.0)
    assert counted(t).settled.get("p", {}).get(A, 0.0) == 0.0


_TIMES = st.integers(40, 120).map(lambda i: i / 100)   # on the 10 ms report grid: ties with the reports


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_TIMES, st.integers(1, 30).map(lambda i: i / 100), st.sampled_from((8192.0, 18432.0))),
                max_size=8),
       st.lists(st.tuples(_TIMES, st.integers(1, 30).map(lambda i: i / 100), st.sampled_from((8192.0, 18432.0))),
                max_size=8),
       st.integers(60, 100).map(lambda i: i / 100))
def test_a_pickers_baseline_is_never_above_what_the_sample_holds_of_the_others(q, p, taken):
    """Whatever the picks and ends around the sample (ties with the reports included), the others' memory
    p's baseline counts in a sample (their certain share plus what the count settles) is at most the
    memory of their requests the sample truly holds: above it, p would credit memory the GPU never
    gave back (an estimate too high: an OOM)."""
    q_spans = [(s, s + d, m) for s, d, m in q]
    p_spans = [(s, s + d, m) for s, d, m in p]
    t, _ = _two_pickers(q_spans, p_spans, taken=taken)
    truth = sum(m for s, e, m in q_spans if s <= taken < e)
    assert counted(t).others("p").get(A, 0.0) <= truth + 1e-6


def test_a_pick_counted_again_by_the_next_report_is_not_a_second_doubtful_request():
    """A pick at a report's very clock reading is in that report and counted again in the next one's picks
    (the picker cannot tell it came before the report was built). The second count is no new request (the
    requests in flight did not rise): it must not add a 0 MiB doubtful request that the count would settle
    first (the lab's multi_gateway: an 8 GiB request of another picker left out of the baseline so)."""
    t = LoadTable(expiry_s=1000.0)
    for seq, (at, n, picks) in enumerate([(0.94, 0, 0), (0.975, 1, 1), (0.985, 1, 1), (0.995, 1, 0), (1.005, 1, 0),
                                          (1.1, 1, 0)], 1):
        t.record(Report("q", seq, endpoints={("c", A): Load(n, 0.0, 8192.0 * n, 0.0, picks)}), at)
        t.record(Report("p", seq), at)
    t.set_memory({A: (0.0, 1.0)}, held={A: 1})
    assert counted(t).settled["p"] == {A: 8192.0}
