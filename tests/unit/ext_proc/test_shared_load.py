"""The picker's side of the shared load view: own + others, the seam in the handler, and the client
stream against a real control-plane service (grpc.aio on a loopback port)."""

from __future__ import annotations

import asyncio
import time

from ext_proc.handler import PickerHandler
from ext_proc.inflight import FINISHED_KEEP, InFlight, MemorySamples
from ext_proc.load_client import Wake, memory_of, report_message, run_load_view, view_others
from ext_proc.picker import pick
from ext_proc.shared_load import NO_OTHERS, SharedLoad, others_of
from ext_proc.view import ViewHolder
from protos import load_view_pb2
from tests.support.loadview import load_view_server, others_at
from tests.unit.ext_proc.test_scheduler import FOUR, headers, view
from xds_server.loadview.exchange import report_from, view_message
from xds_server.loadview.rounds import FINISH_LAG_S, PICK_SLACK_S
from xds_server.loadview.table import LoadTable

A, B = FOUR[0], FOUR[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_others_are_the_totals_minus_the_own_share_never_below_zero():
    o = others_of({("c", A): (5, 5.0, 500.0), ("d", A): (1, 2.0, 0.0), ("c", B): (1, 1.0, 10.0)},
                  {"c": (6, 6.0), "d": (1, 2.0)},
                  {("c", A): (2, 2.0, 200.0), ("c", B): (3, 3.0, 30.0)}, {"c": (5, 5.0)}, pickers=2)
    assert o.work == {A: 5.0} and o.in_flight == {A: 4.0} and o.memory_mib == {A: 300.0}
    assert B not in o.work, "own share above the total (a newer own report) counts 0, not negative"
    assert o.clusters == {"c": 1.0, "d": 1.0} and o.cluster_work == {"c": 1.0, "d": 2.0} and o.pickers == 2


def test_the_loads_read_are_own_live_plus_others_at_the_views_time():
    f = InFlight(expiry_s=10)
    shared = SharedLoad(f)
    f.picked("c", A, work=1.0)
    shared.set_others(others_of({("c", A): (3, 3.0, 0.0)}, {"c": (3, 3.0)}, {("c", A): (1, 1.0, 0.0)},
                                {"c": (1, 1.0)}))
    f.picked("c", A, work=0.5)  # a pick since the view counts at once
    assert shared.work.get(A, 0.0) == 1.5 + 2.0
    assert shared.cluster_work.get("c", 0.0) == 3.5 and shared.clusters.get("c", 0) == 4
    assert shared.work.get(B, 0.0) == 0.0 and A in shared.work and set(shared.work) == {A}
    shared.set_others(NO_OTHERS)
    assert shared.work.get(A, 0.0) == 1.5


def test_free_memory_subtracts_what_the_others_added_since_the_sample():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    shared = SharedLoad(f)
    others = {("c", A): (2, 2.0, 4000.0)}
    shared.set_others(others_of(others, {}, {}, {}))
    f.set_samples(MemorySamples.of({A: (20000.0, clock.now)}))  # the sample already holds the others' 4000 MiB
    assert shared.free.get(A, None) == 20000.0
    shared.set_others(others_of({("c", A): (3, 3.0, 10000.0)}, {}, {}, {}))
    assert shared.free.get(A, None) == 14000.0, "6000 MiB sent by the others since the sample"
    f.picked("c", A, mib=1000.0)
    assert shared.free.get(A, None) == 13000.0
    assert shared.free.get(B, "unknown") == "unknown"


def test_the_control_planes_baseline_counts_what_the_others_sent_between_the_sample_and_its_arrival():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    shared = SharedLoad(f)
    shared.set_others(others_of({("c", A): (3, 3.0, 9000.0)}, {}, {}, {}))  # the others now
    shared.free.rebase({A: 3000.0})  # ... but only 3000 MiB when the sample was taken
    f.set_samples(MemorySamples.of({A: (20000.0, clock.now - 0.5)}))
    assert shared.free.get(A, None) == 14000.0, "6000 MiB sent by the others after the sample was taken"
    # a later sample without a baseline: taken at its first read
    f.set_samples(MemorySamples.of({A: (15000.0, clock.now)}))
    assert shared.free.get(A, None) == 15000.0


def test_the_table_gives_the_others_memory_at_a_past_time():
    t = LoadTable(expiry_s=5.0)
    for at, mib in ((1.0, 100.0), (2.0, 300.0), (3.0, 700.0)):
        t.record(report_from(_mib_report("them", int(at), mib)), now=at)
    t.record(report_from(_mib_report("me", 1, 5000.0)), now=2.5)
    assert others_at(t, "me", A, 2.4) == 300.0 and others_at(t, "me", A, 0.5) == 100.0
    assert others_at(t, "me", A, 9.0) == 700.0 and others_at(t, "them", A, 9.0) == 5000.0


def test_the_baseline_leaves_out_what_finished_just_before_the_sample_and_was_reported_after_it():
    """The multi_gateway OOMs: another picker's 8 GiB request ended 20 ms before the sample (free in
    it) and was reported 30 ms after: in the baseline it would be credited again once the others'
    memory in flight drops, and the picker would see 8 GiB that are not there."""
    t = LoadTable(expiry_s=5.0)
    t.record(report_from(_mib_report("them", 1, 8192.0)), now=1.0)
    t.record(report_from(_mib_report("them", 2, 0.0, finished=((8192.0, 1.13),))), now=2.03)  # picked at 0.9
    assert others_at(t, "me", A, 2.0) == 0.0
    # Finished later than the lag after the sample: it was running in the sample, so it stays.
    assert others_at(t, "me", A, 2.03 - FINISH_LAG_S - 0.01) == 8192.0
    # A pick reported within the slack before the sample may not have reached the endpoint yet.
    t.record(report_from(_mib_report("them", 3, 4096.0)), now=3.0)
    assert others_at(t, "me", A, 3.0 + PICK_SLACK_S / 2) == 0.0
    assert others_at(t, "me", A, 3.0 + PICK_SLACK_S * 2) == 4096.0


def test_the_baseline_subtracts_only_finished_requests_it_counted():
    """Two of the others' requests X, Y in flight before the sample; Y ends before it, and Z, picked
    after, starts and ends around it: the sample holds X alone (Z's end takes nothing off)."""
    t = LoadTable(expiry_s=5.0)
    t.record(report_from(_mib_report("them", 1, 16384.0)), now=10.0)                               # X, Y
    t.record(report_from(_mib_report("them", 2, 8192.0, finished=((8192.0, 0.22),))), now=10.12)    # Y
    t.record(report_from(_mib_report("them", 3, 8192.0, finished=((8192.0, 0.05),))), now=10.18)    # Z
    assert others_at(t, "me", A, 10.1) == 8192.0


def test_a_picker_does_not_credit_twice_what_another_finished_before_the_sample():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    shared = SharedLoad(f)
    t = LoadTable(expiry_s=5.0)
    t.record(report_from(_mib_report("them", 1, 8192.0)), now=clock.now - 0.5)
    shared.set_others(others_of({("c", A): (1, 1.0, 8192.0)}, {}, {}, {}))
    t.record(report_from(_mib_report("them", 2, 0.0, finished=((8192.0, 0.6),))), now=clock.now + 0.03)
    shared.set_others(others_of({}, {}, {}, {}))   # the others' request is reported finished
    shared.free.rebase({A: others_at(t, "me", A, clock.now)})
    f.set_samples(MemorySamples.of({A: (24576.0, clock.now)}))       # taken after it ended: the GPU is empty
    assert shared.free.get(A, None) == 24576.0, "not 24 GiB + 8 GiB"


def _mib_report(picker: str, seq: int, mib: float, finished: tuple[tuple[float, float], ...] = ()):
    """A report of ``mib`` in flight on A, and ``finished`` requests as (MiB, picked how long before)."""
    return load_view_pb2.LoadReport(picker=picker, seq=seq, endpoints=[
        load_view_pb2.EndpointLoad(cluster="c", endpoint=A, in_flight=1 if mib else 0, work=1 if mib else 0,
                                   memory_mib=mib)],
        finished=[load_view_pb2.FinishedRequests(endpoint=A, memory_mib=[m for m, _ in finished],
                                                 picked_age_s=[age for _, age in finished])] if finished else [])


def test_the_second_picker_bounds_on_the_first_pickers_load():
    """Two pickers, one ring: picker 2 alone would keep a key on its owner; with picker 1's requests
    on that owner in the view, the owner is over its bound and picker 2 spills."""
    v = view()
    h = headers(x_session_id=b"s-1")
    owner = pick(h, v, InFlight()).endpoint
    first, second = InFlight(), InFlight()
    for _ in range(6):
        first.picked("c", owner)
    alone = pick(h, v, second)
    shared = SharedLoad(second)
    shared.set_others(others_of({("c", owner): (6, 6.0, 0.0)}, {"c": (6, 6.0)}, {}, {}))
    together = pick(h, v, shared)
    assert alone.endpoint == owner and alone.reason == "affinity"
    assert together.endpoint != owner and together.reason == "spilled"


def test_share_load_is_the_one_seam_of_the_request_control():
    control = PickerHandler(ViewHolder(view())).control
    assert control.loads is control.inflight
    shared = control.share_load()
    assert control.loads is shared and control.share_load() is shared and shared.inflight is control.inflight


def test_a_report_carries_the_live_load_and_picks_since_the_last_report():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    f.picked("c", A, work=2.0, mib=100.0, prompt_tokens=30, output_tokens=10)
    clock.now += 0.05
    since = clock.now
    clock.now += 0.05
    f.picked("c", A, work=1.0, mib=50.0)
    f.picked("c", None)
    msg = report_message(f, "p1", 7, since)
    r = report_from(msg)  # what the control plane reads back
    assert r.picker == "p1" and r.seq == 7
    load = r.endpoints[("c", A)]
    assert (load.in_flight, load.work, load.memory_mib, load.tokens, load.picks) == (2, 3.0, 150.0, 40.0, 1)
    assert r.clusters["c"].in_flight == 3 and r.clusters["c"].work == 3.0


def test_a_pick_at_the_previous_reports_clock_reading_counts_as_a_pick_since_it():
    """The report before may have been built before that pick at the same reading: left out of both,
    the control plane's count of the requests a memory sample may hold came out one short
    (``rounds.maybe_held``), and a picker's share of the held count one request high."""
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    since = clock.now
    f.picked("c", A, mib=100.0)
    load = report_from(report_message(f, "p1", 1, since)).endpoints[("c", A)]
    assert (load.in_flight, load.picks) == (1, 1)


def test_a_report_carries_the_memory_finished_since_the_last_report_once():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    f.picked("c", A, mib=8192.0)
    f.picked("c", A, mib=4096.0)
    clock.now += 0.25
    f.finish(A)
    assert report_from(report_message(f, "p1", 1, 0.0)).finished == ((A, 0.25, 8192.0),)
    assert report_from(report_message(f, "p1", 2, 0.0)).finished == ()


def test_a_report_carries_each_endpoints_finished_requests_in_packed_arrays():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    for endpoint, mib in ((A, 100.0), ("10.0.0.2:8000", 200.0), (A, 300.0)):
        f.picked("c", endpoint, mib=mib)
    clock.now += 0.5
    f.finish(A)
    f.finish("10.0.0.2:8000")
    f.finish(A)
    msg = report_message(f, "p1", 1, 0.0)
    assert [(e.endpoint, list(e.memory_mib)) for e in msg.finished] == [(A, [100.0, 300.0]),
                                                                         ("10.0.0.2:8000", [200.0])]
    assert sorted(report_from(msg).finished) == sorted([("10.0.0.2:8000", 0.5, 200.0), (A, 0.5, 100.0),
                                                        (A, 0.5, 300.0)])
    assert f.finished == {}


def test_finished_requests_no_report_takes_are_bounded():
    f = InFlight(expiry_s=10, clock=Clock())
    for _ in range(FINISHED_KEEP + 5):
        f.picked("c", A, mib=1.0)
        f.finish(A)
    f.expire()
    picked, mibs = f.finished[A]
    assert len(picked) == len(mibs) == FINISHED_KEEP


def test_finished_requests_are_bounded_over_endpoints_keeping_each_ones_newest():
    clock = Clock()
    f = InFlight(expiry_s=100, clock=clock)
    for i in range(FINISHED_KEEP):  # three quarters on A, a quarter on B; picked at 0, 1, 2 ... s
        endpoint = "10.0.0.2:8000" if i % 4 == 0 else A
        f.picked("c", endpoint, mib=1.0)
        f.finish(endpoint)
        clock.now += 0.001
    for endpoint in (A, "10.0.0.2:8000"):
        f.picked("c", endpoint, mib=2.0)
        f.finish(endpoint)
    f.expire()
    picked_a, mib_a = f.finished[A]
    picked_b, mib_b = f.finished["10.0.0.2:8000"]
    assert len(picked_a) + len(picked_b) <= FINISHED_KEEP and len(picked_a) > 2 * len(picked_b)
    assert mib_a[-1] == mib_b[-1] == 2.0 and picked_a[0] > 0.0  # the newest kept, the oldest dropped


def test_a_view_from_the_control_plane_gives_the_others_load():
    t = LoadTable(expiry_s=1.0)
    mine, theirs = InFlight(), InFlight()
    mine.picked("c", A)
    for _ in range(3):
        theirs.picked("c", A)
    t.record(report_from(report_message(theirs, "them", 1, 0.0)), now=1.0)
    t.record(report_from(report_message(mine, "me", 1, 0.0)), now=1.0)
    o = view_others(view_message(t.totals(1.0), t.report("me"), 1))
    assert o.in_flight == {A: 3.0} and o.clusters == {"c": 3.0} and o.pickers == 2


async def until(cond, seconds: float = 3.0) -> None:
    """Poll ``cond`` every 10 ms until it holds; AssertionError after ``seconds``."""
    for _ in range(int(seconds / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached in {seconds:g} s")


async def test_two_pickers_share_their_load_through_the_control_plane_and_a_dead_one_stops_counting():
    table = LoadTable(expiry_s=0.5)
    one, two = SharedLoad(InFlight()), SharedLoad(InFlight())
    for _ in range(4):
        one.inflight.picked("c", A)
    seen: list[tuple[float, float]] = []  # picker two's views: (the others' work on A before, after)
    async with load_view_server(table) as target:
        tasks = [asyncio.create_task(run_load_view(target, "one", one, 0.02, 0.5)),
                 asyncio.create_task(run_load_view(target, "two", two, 0.02, 0.5, on_view=lambda before: seen.append(
                     (before.work.get(A, 0.0), two.others.work.get(A, 0.0)))))]
        try:
            await until(lambda: two.work.get(A, 0.0) == 4.0)
            assert two.clusters.get("c", 0) == 4 and one.work.get(A, 0.0) == 4.0, "own load is not counted twice"
            assert (0.0, 4.0) in seen, "on_view is told the others' load before each view"
            tasks[0].cancel()  # picker one dies
            await until(lambda: two.work.get(A, 0.0) == 0.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_picker_alone_or_beside_idle_ones_sends_only_keep_alives_and_reports_changes_once_another_picks():
    table = LoadTable(expiry_s=1.0)
    reports: list[str] = []
    record = table.record

    def counting(report, now):
        reports.append(report.picker)
        return record(report, now)

    table.record = counting  # type: ignore[method-assign]
    one, two = SharedLoad(InFlight()), SharedLoad(InFlight())

    async def changes(n: int, every_s: float) -> int:
        """Reports picker one sent while it made ``n`` changes, one every ``every_s``."""
        before = reports.count("one")
        for _ in range(n):
            one.inflight.picked("c", A)
            await asyncio.sleep(every_s)
        return reports.count("one") - before

    async with load_view_server(table) as target:
        tasks = [asyncio.create_task(run_load_view(target, "one", one, 0.01, 1.0))]
        try:
            sent = await changes(60, 0.01)  # a change every 10 ms for 0.6 s: alone, none of them is news
            assert 1 <= sent <= 5, f"{sent} reports in 0.6 s alone (keep-alive every 0.25 s)"
            # A second picker that no Envoy sends traffic to (the control plane's own, beside
            # standalone ones) decides nothing: still only keep-alives.
            tasks.append(asyncio.create_task(run_load_view(target, "two", two, 0.01, 1.0)))
            await until(lambda: one.others.pickers == 2 and one.others.idle == 1)
            sent = await changes(60, 0.01)
            assert 1 <= sent <= 5, f"{sent} reports in 0.6 s beside an idle picker"
            two.inflight.picked("c", A)  # picker two gets traffic: from now on every change is news
            await until(lambda: one.others.idle == 0)
            sent = await changes(20, 0.02)
            assert sent >= 10, f"{sent} reports for 20 changes 20 ms apart with a busy picker beside"
            assert two.work.get(A, 0.0) >= 130.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_standalone_picker_gets_the_control_planes_memory_samples_once_per_round():
    table = LoadTable(expiry_s=1.0)
    shared = SharedLoad(InFlight())
    got: list[MemorySamples] = []

    def on_samples(samples: MemorySamples) -> None:
        got.append(samples)
        shared.inflight.set_samples(samples)

    async with load_view_server(table) as target:
        task = asyncio.create_task(run_load_view(target, "one", shared, 0.01, 1.0, on_samples=on_samples))
        try:
            table.set_memory({A: (20480.0, time.monotonic() - 0.5)})
            await until(lambda: len(got) == 1)
            [(endpoint, free)] = got[0].free.items()
            assert endpoint == A and free == 20480.0
            assert shared.inflight.now() - 1.0 < got[0].taken_at[A] <= shared.inflight.now() - 0.5
            assert shared.free.get(A) == 20480.0, "no other picker: nothing of theirs to subtract"
            await asyncio.sleep(0.3)
            assert len(got) == 1, "the same round is not taken twice"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_sample_younger_than_the_finish_lag_goes_out_once_the_others_finished_requests_are_in():
    """Its baseline subtracts the requests the others reported finished up to FINISH_LAG_S after it
    was taken: sent before then, the baseline would still hold some, and the picker credit them twice."""
    table = LoadTable(expiry_s=0.2)
    shared = SharedLoad(InFlight())
    got: list[float] = []
    async with load_view_server(table) as target:  # keep-alives every 50 ms: views go out that often
        task = asyncio.create_task(run_load_view(target, "one", shared, 0.01, 0.2,
                                                 on_samples=lambda s: got.append(time.monotonic())))
        try:
            await until(lambda: shared.grants.view > 0)
            taken = time.monotonic()
            table.set_memory({A: (20480.0, taken)})
            await until(lambda: bool(got))
            assert got[0] - taken >= FINISH_LAG_S
            assert table.memory_ready_at == taken + FINISH_LAG_S
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_a_standalone_picker_settles_its_doubtful_requests_with_its_own_share_of_the_held_count():
    """A request picked at the sample's time (maybe not on the GPU yet) ended before the sample arrived:
    doubtful, its memory is not credited. The backend's whole count cannot settle it while another
    picker decides (the count holds theirs too); this picker's own share of it, from the control
    plane (``MemorySample.held``), can, whoever decides: held 1, the sample held it."""
    clock = Clock()
    handler = PickerHandler(ViewHolder(view()), InFlight(expiry_s=100.0, clock=clock))
    shared = handler.control.share_load()
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    assert not shared.alone()
    handler.control.set_samples(MemorySamples.of({A: (24576.0, 99.0)}))  # known from before
    handler.control.inflight.picked("c", A, mib=8192.0)
    clock.now += 0.2
    handler.control.inflight.completed("c", A)
    clock.now += 1.0
    sample = {A: (10000.0, 100.0)}
    handler.control.set_samples(MemorySamples.of(sample, {A: 1.0}))
    assert shared.free.get(A) == 10000.0, "the backend's whole count is not used while another picker decides"
    msg = load_view_pb2.LoadView(memory_round=1)
    msg.memory.add(endpoint=A, free_mib=10000.0, age_s=clock.now - 100.0, held=1.0)
    _, own = memory_of(msg, clock.now)
    assert own.own and own.held == {A: 1.0}
    handler.control.set_samples(own)
    assert shared.free.get(A) == 18192.0, "its own share settles it: the sample held the request"
    msg.memory[0].ClearField("held")
    assert memory_of(msg, clock.now)[1].held is None


async def test_the_report_loops_wake_times_out_or_ends_when_set():
    """Wake.wait: at once when set, until the timeout when not, and sooner when set meanwhile."""
    loop = asyncio.get_running_loop()
    wake = Wake()
    start = loop.time()
    await wake.wait(0.05)
    assert loop.time() - start >= 0.045 and not wake.is_set()
    loop.call_later(0.01, wake.set)
    start = loop.time()
    await wake.wait(5.0)
    assert loop.time() - start < 2.0 and wake.is_set()
    start = loop.time()
    await wake.wait(5.0)  # still set: at once
    assert loop.time() - start < 1.0
    wake.clear()
    task = asyncio.ensure_future(wake.wait(5.0))
    await asyncio.sleep(0)
    task.cancel()  # a cancelled wait leaves no timer and no waiter behind
    await asyncio.gather(task, return_exceptions=True)
    assert wake._waiter is None and not wake.is_set()
