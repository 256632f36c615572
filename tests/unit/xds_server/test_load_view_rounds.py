"""The load view's memory rounds, counted off the event loop (xds_server/loadview/rounds.py,
LoadViewServicer.Share): capacity rounds kept through a missing sample, no round counted before it is
ready, and views (with their grant answers) that do not wait for a round's count."""

from __future__ import annotations

import asyncio
import threading

from protos import load_view_pb2
from tests.support.loadview import Context, counted, reports_from
from xds_server.loadview.rounds import CAPACITY_ROUNDS
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
