"""Review of the load view's memory rounds counted off the event loop (xds_server/loadview/rounds.py,
LoadViewServicer.Share): cases where the new counting departs from the per-report walk it replaced,
or from the rule that a round is not counted before it is ready."""

from __future__ import annotations

from tests.support.loadview import counted
from xds_server.loadview.rounds import CAPACITY_ROUNDS
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

