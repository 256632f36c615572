"""The endpoint's capacity (the GPU memory its requests can use), learned by the control plane from
its memory rounds, caps every picker's free-memory estimate (multi_gateway: estimates of 32 and 40 GiB
free on an A10 whose requests can use 24 GiB, each one an OOM waiting to happen)."""

from __future__ import annotations

from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.load_client import view_capacities
from ext_proc.shared_load import SharedLoad, others_of
from protos import load_view_pb2
from tests.support.loadview import counted
from tests.unit.ext_proc.test_scheduler import FOUR
from xds_server.loadview.exchange import memory_message, report_from
from xds_server.loadview.rounds import CAPACITY_ROUNDS, FINISH_LAG_S, RoundCounts
from xds_server.loadview.table import LoadTable

A, B = FOUR[0], FOUR[1]


def _report(picker: str, seq: int, mib: float) -> load_view_pb2.LoadReport:
    return load_view_pb2.LoadReport(picker=picker, seq=seq, endpoints=[
        load_view_pb2.EndpointLoad(cluster="c", endpoint=A, in_flight=1 if mib else 0, work=1 if mib else 0,
                                   memory_mib=mib)])


def _round(t: LoadTable, at: float, free: float, mib: float, seq: int) -> dict[str, float]:
    """One memory round: another picker reports ``mib`` in flight on A, then A's sample shows ``free``."""
    t.record(report_from(_report("them", seq, mib)), now=at - 0.5)
    t.set_memory({A: (free, at), B: (30000.0, at)})
    return dict(counted(t).capacities)


def test_the_capacity_is_free_plus_what_the_pickers_had_in_flight_median_over_rounds():
    t = LoadTable(expiry_s=5.0)
    assert _round(t, 10.0, 16384.0, 8192.0, 1) == {A: 24576.0}, "B: no picker sent it memory, no capacity"
    assert _round(t, 11.0, 24576.0, 0.0, 2) == {A: 24576.0}
    # One round's count is off (a request counted in flight had ended: 8 GiB too many): not learned.
    assert _round(t, 12.0, 24576.0, 8192.0, 3) == {A: 24576.0}


def test_the_capacity_follows_a_lasting_change_within_the_rounds_it_is_learned_over():
    t = LoadTable(expiry_s=60.0)
    for i in range(CAPACITY_ROUNDS):
        _round(t, 10.0 + i, 20480.0, 4096.0, i + 1)
    caps = {}
    for i in range(CAPACITY_ROUNDS):   # another tenant took 4 GiB of the GPU for good
        caps = _round(t, 30.0 + i, 16384.0, 4096.0, 100 + i)
        if i < CAPACITY_ROUNDS // 2:
            assert caps == {A: 24576.0}, f"round {i} of the change: not learned yet"
    assert caps == {A: 20480.0}


def test_the_capacity_travels_with_the_samples_in_the_view():
    t = LoadTable(expiry_s=5.0)
    t.record(report_from(_report("them", 1, 8192.0)), now=9.5)
    t.set_memory({A: (16384.0, 10.0)})
    view = memory_message(counted(t), None, 10.0 + FINISH_LAG_S)
    assert view_capacities(view) == {A: 24576.0}
    bare = memory_message(RoundCounts(1, {A: (16384.0, 10.0)}), None, 10.0)
    assert view_capacities(bare) == {}, "0 is 'not known': no cap"


def test_the_estimate_never_exceeds_the_capacity_less_the_memory_in_flight_there():
    f = InFlight(expiry_s=10, clock=lambda: 100.0)
    shared = SharedLoad(f)
    f.set_samples(MemorySamples.of({A: (24576.0, 99.0)}))
    shared.set_others(others_of({("c", A): (1, 1.0, 8192.0)}, {}, {}, {}))
    shared.free.rebase({A: 0.0})   # the baseline says the others had nothing there at the sample
    f.set_samples(MemorySamples.of({A: (24576.0, 99.0)}))
    assert shared.free.get(A) == 16384.0
    f.picked("c", A, mib=8192.0)
    assert f.memory == {A: 8192.0}
    # A completion credited twice: the own estimate climbs above what the GPU has.
    f.free[A] += 16384.0
    assert shared.free.get(A) == 24576.0, "without a capacity the double credit stands"
    shared.free.capacity = {A: 24576.0}
    assert shared.free.get(A) == 24576.0 - 8192.0 - 8192.0
    f.finish(A)
    assert f.memory == {}, "a finished request's memory leaves the endpoint's"
    assert shared.free.get(A) == 24576.0 - 8192.0


def test_a_busy_endpoints_capacity_counts_the_picks_that_reached_it_just_before_the_sample():
    """An endpoint that takes a pick in most samples' last PICK_SLACK_S (50 ms; > 14 requests/s):
    the pick is on the GPU at the sample (a pick reaches its node in ~10 ms), so the sample's free
    memory is without it. Read with the baseline's rule (reports received by ``at - PICK_SLACK_S``,
    the side that leaves less free memory for a baseline), the implied capacity missed that pick's
    memory in every such round, and the median learned one request too little: 16 GiB on a GPU
    whose requests can use 24, the cap refusing 8 GiB requests the GPU had room for."""
    t = LoadTable(expiry_s=60.0)
    caps = {}
    for i in range(CAPACITY_ROUNDS):
        at = 10.0 + i
        t.record(report_from(_report("them", 2 * i + 1, 8192.0)), now=at - 0.5)    # one request running
        t.record(report_from(_report("them", 2 * i + 2, 16384.0)), now=at - 0.02)  # and one picked 20 ms before
        t.set_memory({A: (8192.0, at)})                                             # both on the GPU
        t.record(report_from(_report("them", 2 * i + 2, 16384.0)), now=at + FINISH_LAG_S)
        caps = dict(counted(t).capacities)
    assert caps == {A: 24576.0}
