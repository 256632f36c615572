"""The slow loop keeps the event loop free: the engine, the change log and the snapshot build run in
a worker thread, and a hook's awaitable (the picker's view rebuilt in a thread) is awaited in order
(issue 15, scale: a 60 000-endpoint round froze xDS, the picker and the admin API)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import pytest

from tests.support.factories import config, metrics_source, service, version
from xds_server import control as control_module
from xds_server.ads.server import SnapshotCache
from xds_server.control import ControlPlane
from xds_server.metrics.stats import EndpointStats

CFG = config([service("chat", [version("v1", [{"address": "10.1.0.1:8000"}, {"address": "10.1.0.2:8000"}])])])


async def test_engine_and_snapshot_build_run_off_the_event_loop(monkeypatch):
    loop_thread = threading.current_thread()
    seen: dict[str, threading.Thread] = {}
    real_compute, real_build = control_module.compute_weights, control_module.build_snapshot

    def compute(*args, **kw):
        seen["engine"] = threading.current_thread()
        return real_compute(*args, **kw)

    def build(*args, **kw):
        seen["build"] = threading.current_thread()
        return real_build(*args, **kw)

    monkeypatch.setattr(control_module, "compute_weights", compute)
    monkeypatch.setattr(control_module, "build_snapshot", build)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    def fetch(instances):
        return {i: EndpointStats(sample_age_s=1.0, gpu_util=0.5) for i in instances}

    order: list[str] = []

    async def slow_hook_work():
        await asyncio.sleep(0.01)
        order.append("hook done")

    cp = ControlPlane(CFG, metrics_source(fetch), SnapshotCache(), [lambda snap, w: slow_hook_work()],
                      lambda: "127.0.0.1:1")
    t = asyncio.create_task(ticker())
    assert await cp.run_round()
    order.append("round done")
    t.cancel()
    assert seen["engine"] is not loop_thread and seen["build"] is not loop_thread
    assert ticks > 0  # the loop ran other tasks while the round worked
    assert order == ["hook done", "round done"]  # the hook's awaitable was awaited before the round ended
    assert {w.address for w in cp.weights} == {"10.1.0.1:8000", "10.1.0.2:8000"}


async def test_a_round_that_changes_every_weight_logs_a_bounded_number_of_lines(caplog):
    import logging

    from xds_server.control import MAX_CHANGE_LINES

    cfg = config([service("chat", [version("v1", MAX_CHANGE_LINES + 50)])])
    cp = ControlPlane(cfg, metrics_source(lambda i: {x: EndpointStats(sample_age_s=1.0) for x in i}),
                      SnapshotCache(), [], lambda: "127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="xds_server.control"):
        await cp.run_round()
    lines = [r.getMessage() for r in caplog.records if r.name == "xds_server.control"]
    assert sum(m.startswith("weight ") for m in lines) == MAX_CHANGE_LINES
    assert any(m.startswith("... and 50 more weight or health changes") for m in lines)


async def test_the_round_context_spans_the_whole_round_and_round_hooks_may_be_awaited():
    events: list[str] = []

    @contextlib.contextmanager
    def round_context():
        events.append("enter")
        try:
            yield
        finally:
            events.append("exit")

    async def on_round(weights):
        await asyncio.sleep(0.01)
        events.append(f"on_round {len(weights)}")

    def fetch(instances):
        return {i: EndpointStats(sample_age_s=1.0, gpu_util=0.5) for i in instances}

    cp = ControlPlane(CFG, metrics_source(fetch), SnapshotCache(), [lambda snap, w: events.append("snapshot")],
                      lambda: "127.0.0.1:1", on_round=[on_round], round_context=round_context)
    assert await cp.run_round()
    assert events == ["enter", "on_round 2", "snapshot", "exit"]


async def test_the_round_context_is_left_when_a_round_fails(monkeypatch):
    left: list[bool] = []

    @contextlib.contextmanager
    def round_context():
        try:
            yield
        finally:
            left.append(True)

    def broken(*args, **kw):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(control_module, "compute_weights", broken)
    cp = ControlPlane(CFG, metrics_source(lambda i: {x: EndpointStats(sample_age_s=1.0) for x in i}),
                      SnapshotCache(), [], lambda: "127.0.0.1:1", round_context=round_context)
    with pytest.raises(RuntimeError, match="engine bug"):
        await cp.run_round()
    assert left == [True]


async def test_rounds_never_overlap_when_a_source_is_slower_than_the_interval():
    """``loop.timeout_s`` above ``loop.interval_s`` is allowed: a slow round delays the next one, which
    then starts at once (no sleep), never while the round before is still fetching."""
    cfg = config([service("chat", [version("v1", 1)])], loop={"interval_s": 0.3, "timeout_s": 0.5})
    running, most, spans = 0, 0, []

    def slow(instances):  # 0.4 s: past interval_s, well inside 3 x timeout_s
        nonlocal running, most
        running += 1
        most = max(most, running)
        started = time.monotonic()
        try:
            time.sleep(0.4)
            return {i: EndpointStats(sample_age_s=1.0) for i in instances}
        finally:
            spans.append((started, time.monotonic()))
            running -= 1

    cp = ControlPlane(cfg, metrics_source(slow), SnapshotCache(), [], lambda: "127.0.0.1:1")
    task = asyncio.create_task(cp.run())
    while len(spans) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert most == 1  # no round fetched while the one before was still fetching
    assert cp.metrics_ok  # a slow answer within the timeout is a good round
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end  # one after the other
        assert start - end < 0.15  # and at once: no interval_s (0.3 s) sleep after a round that ran past it



class _Stuck(BaseException):
    """Ends a loop that lost its cancellation (not an Exception: the loop does not catch it)."""


async def test_a_cancelled_loop_stops_even_when_its_fetch_has_just_answered():
    """Cancelling :meth:`ControlPlane.run` always stops it. Python 3.11's ``asyncio.wait_for`` loses a
    cancellation that arrives as its inner future completes (CPython gh-86296), and the loop then ran
    rounds forever: a test awaiting the cancelled task hung until CI's limit. Cancels land at many
    points of rounds whose fetch answers at once."""
    stuck = False

    def fetch(instances):
        if stuck:
            raise _Stuck
        return {x: EndpointStats(sample_age_s=1.0) for x in instances}

    cfg = config([service("chat", [version("v1", 1)])], loop={"interval_s": 0.001, "timeout_s": 0.5})
    cp = ControlPlane(cfg, metrics_source(fetch), SnapshotCache(), [], lambda: "127.0.0.1:1")
    for attempt in range(300):
        task = asyncio.create_task(cp.run())
        for _ in range(attempt % 7):
            await asyncio.sleep(0)
        await asyncio.sleep(attempt % 3 * 0.0005)
        task.cancel()
        for _ in range(500):   # up to ~5 s
            if task.done():
                break
            await asyncio.sleep(0.01)
        if not task.done():
            stuck = True
            with contextlib.suppress(_Stuck):
                await task
            pytest.fail(f"the loop went on after its cancellation (attempt {attempt})")


async def test_the_stats_are_dated_when_the_fetch_returned_not_when_the_loop_took_them():
    """The picker dates each GPU memory sample from ``stats_at`` minus its age: read after a busy
    event loop takes the answer, it was late by however long the loop was busy, and the picker then
    counted requests the sample already held as sent after it."""
    returned: list[float] = []

    def fetch(instances):
        time.sleep(0.05)
        returned.append(time.monotonic())
        return {x: EndpointStats(sample_age_s=1.0) for x in instances}

    cp = ControlPlane(CFG, metrics_source(fetch), SnapshotCache(), [], lambda: "127.0.0.1:1")
    asyncio.get_running_loop().call_later(0.01, time.sleep, 0.3)  # the loop is busy as the fetch returns
    assert await cp.run_round()
    assert cp.stats_at is not None and abs(cp.stats_at - returned[0]) < 0.05
