"""The picker's side of the shared load view: the I/O shell around :mod:`ext_proc.shared_load`.

The picker sends its whole live load (``LoadReport``, ``protos/inferlb/v1/load_view.proto``) to the
control plane when it changed (a pick or a completion) and the last view showed other pickers with
traffic (picks or requests in flight in their last ``expiry_s``; an idle one decides nothing), at
most once per ``interval_s`` (default 10 ms: changes in between travel together), and at least
every quarter of ``expiry_s`` (so it keeps counting; the only reports of a picker alone in the
view: a report costs CPU on both sides, and a change is news only to the others), and at once when
a memory grant request waits (:mod:`ext_proc.grants`). It takes each ``LoadView`` it gets back,
answers to its own reports and views pushed when another picker reported, into its
:class:`~ext_proc.shared_load.SharedLoad`, and hands the grant answers it carries to the requests
waiting for them.
When the stream breaks, or no view came for ``expiry_s``, the others' load is dropped (the picker
decides on its own load, as without the view) and the stream is opened again with a growing
back-off (0.25 s to 5 s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import Counter

from ext_proc.grants import Grants
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.shared_load import NO_OTHERS, Others, SharedLoad, others_of
from protos import load_view_pb2, load_view_pb2_grpc

__all__ = ["Wake", "apply_view", "memory_of", "report_due", "report_message", "run_load_view", "view_capacities",
           "view_others", "view_samples"]

log = logging.getLogger(__name__)

VIEWS = Counter("inferlb_ext_proc_load_views_total", "Shared load views received from the control plane, "
                "and how often the view was lost (stream broken or stale)", ["outcome"])


def report_message(inflight: InFlight, picker: str, seq: int, since: float,
                   grants: Grants | None = None) -> load_view_pb2.LoadReport:
    """The ``LoadReport`` of ``inflight`` now (picks counted since ``since``, the in-flight clock's s),
    with the memory of the requests finished since the previous report (taken out of ``inflight``),
    ``grants``' waiting requests (taken out of its outbox) and the picker's memory queue (``grants.queue``)."""
    msg = load_view_pb2.LoadReport(picker=picker, seq=seq)
    if grants is not None:
        grants.granted = False
        msg.grants_applied = grants.applied
        msg.view_applied = grants.asked_on if grants.outbox else grants.view
        for request_id, cluster, endpoint, mib, room in grants.take_outbox():
            msg.grant_requests.add(id=request_id, cluster=cluster, endpoint=endpoint, memory_mib=mib, room_mib=room,
                                   waited_s=grants.take_waited(request_id))
        if grants.queue is not None:
            for waiter, cluster, mib, waited in grants.queue():
                msg.waiting.add(id=waiter, cluster=cluster, memory_mib=mib, waited_s=waited)
    for (cluster, endpoint), (n, work, mib, tokens, picks) in inflight.by_endpoint(since).items():
        msg.endpoints.add(cluster=cluster, endpoint=endpoint, in_flight=n, work=work, memory_mib=mib,
                          tokens=tokens, picks=picks)
    cluster_work = inflight.cluster_work
    for cluster, n in inflight.clusters.items():
        msg.clusters.add(cluster=cluster, in_flight=n, work=cluster_work.get(cluster, 0.0))
    finished, inflight.finished = inflight.finished, {}
    now = inflight.now()
    for endpoint, (picked, mibs) in finished.items():
        msg.finished.add(endpoint=endpoint, memory_mib=mibs, picked_age_s=[max(0.0, now - t) for t in picked])
    return msg


def view_others(view: load_view_pb2.LoadView) -> Others:
    """The others' load carried by one ``LoadView`` (its totals minus this picker's share)."""
    return others_of({(e.cluster, e.endpoint): (e.in_flight, e.work, e.memory_mib) for e in view.endpoints},
                     {c.cluster: (c.in_flight, c.work) for c in view.clusters},
                     {(e.cluster, e.endpoint): (e.in_flight, e.work, e.memory_mib) for e in view.own_endpoints},
                     {c.cluster: (c.in_flight, c.work) for c in view.own_clusters},
                     view.pickers, view.idle_others)


def view_samples(view: load_view_pb2.LoadView, now: float) -> dict[str, tuple[float, float]]:
    """The memory samples of a view as :meth:`ext_proc.inflight.InFlight.set_samples` takes them:
    ``{endpoint: (free MiB, taken at)}``, ``taken at`` on the picker's clock (``now`` - their age,
    which is each sample's ``age_s`` plus the view's ``memory_age_s``)."""
    sent = now - view.memory_age_s
    return {m.endpoint: (m.free_mib, sent - m.age_s) for m in view.memory}


def view_capacities(view: load_view_pb2.LoadView) -> dict[str, float]:
    """``{endpoint: GPU memory its requests can use, MiB}`` of the view's samples that carry one (pure)."""
    return {m.endpoint: m.capacity_mib for m in view.memory if m.capacity_mib > 0}


def memory_of(view: load_view_pb2.LoadView, now: float) -> tuple[dict[str, float], MemorySamples]:
    """``(the others' memory in flight per endpoint at the samples, MiB; the samples)`` of ``view`` (pure):
    hand the first to :meth:`SharedLoad.free.rebase <ext_proc.shared_load.SharedLoad>`, then the
    samples to the picker (:meth:`~ext_proc.requestcontrol.RequestControl.set_samples`), with the picker's own
    held counts where the view carries them (``MemorySample.held``: the control plane took the other
    pickers' requests out, so they hold this picker's alone: ``MemorySamples.own``)."""
    held = {m.endpoint: m.held for m in view.memory if m.HasField("held")}
    return ({m.endpoint: m.others_mib for m in view.memory},
            MemorySamples.of(view_samples(view, now), held or None, own=bool(held)))


def apply_view(shared: SharedLoad, view: load_view_pb2.LoadView) -> None:
    """Take one ``LoadView`` into ``shared`` (no I/O): the others' load, the view's number, and its grant
    answers handed to the requests waiting for them (their callbacks run here). A memory round it
    carries is taken apart (:func:`view_capacities`, :func:`memory_of`)."""
    shared.set_others(view_others(view))
    grants = shared.grants
    grants.viewed(view.view)
    for answer in view.grants:
        grants.answer(answer.id, answer.grant, answer.unseen_mib)


class Wake:
    """A flag the report loop waits on, each wait bounded by a timeout, that never raises to time out
    (not thread-safe: the picker's event loop owns it). ``asyncio.timeout`` around ``Event.wait``
    cancelled the wait and turned its CancelledError into a TimeoutError at each of the loop's ticks,
    100 a second: 7.8 % of the picker's samples, ~7.6 µs a decision at ~1 900 decisions a second
    (``inferlb bench picker --body-kb 20 --profile 15``, 2026-12-07)."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Set the flag and end a wait now."""
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        """Clear the flag."""
        self._set = False

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return self._set

    async def wait(self, timeout_s: float) -> None:
        """Return once the flag is set (at once if it is) or ``timeout_s`` seconds have passed."""
        if self._set:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def report_due(shared: SharedLoad, reported: int, since_s: float, keepalive_s: float) -> bool:
    """Whether a report is due at one of the report loop's ticks (pure): the picker's load changed
    since the last report (``reported``: :attr:`InFlight.changes <ext_proc.inflight.InFlight>` then)
    and other pickers decide (a change is news only to them), or ``since_s`` (s since the last report)
    reached ``keepalive_s``. A waiting grant request is sent at once, not at a tick."""
    return (shared.inflight.changes != reported and not shared.alone()) or since_s >= keepalive_s


async def run_load_view(target: str, picker: str, shared: SharedLoad, interval_s: float = 0.01,
                        expiry_s: float = 1.0, on_samples: Callable[[MemorySamples], None] | None = None,
                        backoff_s: float = 0.25, max_backoff_s: float = 5.0,
                        on_view: Callable[[Others], None] | None = None) -> None:
    """Report to and take views from the control plane at ``target`` (``HOST:PORT``) until cancelled.

    ``picker``: this picker's name in the control plane (unique per process). ``on_samples``: given
    the slow loop's GPU memory samples each time a view brings a new round of them (a standalone
    picker's only source; None: ignored, the in-process picker gets them directly). ``on_view``:
    called after each view is taken, with the others' load before it
    (:meth:`~ext_proc.requestcontrol.RequestControl.others_changed`).
    """
    inflight = shared.inflight
    grants = shared.grants
    send_now = Wake()
    grants.wake = send_now.set
    seq = 0
    delay = backoff_s

    def lost(why: str) -> None:
        grants.lost()
        send_now.clear()  # the requests it woke for are gone with the outbox (else the report loop spins)
        if shared.others is not NO_OTHERS:
            VIEWS.labels("lost").inc()
            log.warning("picker: shared load view lost (%s); deciding on this picker's load alone", why)
        shared.set_others(NO_OTHERS)
        shared.viewed_at = None

    keepalive_s = expiry_s / 4

    async def reports() -> AsyncIterator[load_view_pb2.LoadReport]:
        nonlocal seq
        since = inflight.now()
        while True:
            now = inflight.now()
            seq += 1
            reported = inflight.changes
            send_now.clear()
            yield report_message(inflight, picker, seq, since, grants)
            since = now
            while True:
                # Checked before a waiting grant request goes too: under steady grant requests the
                # loop never waits, and a stalled control plane kept a stale view (every admission
                # waiting out its grant) for as long as they came.
                if shared.viewed_at is not None and inflight.now() - shared.viewed_at > expiry_s:
                    lost(f"no view for {expiry_s:g} s")
                if grants.outbox:
                    break
                await send_now.wait(interval_s)  # or at once when a grant request waits
                if grants.outbox:
                    break
                # A change is news only to other pickers that decide (have traffic): without any,
                # keep-alives suffice.
                if report_due(shared, reported, inflight.now() - now, keepalive_s):
                    break

    while True:
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                call = load_view_pb2_grpc.LoadViewServiceStub(channel).Share(reports())
                async for view in call:
                    before = shared.others
                    apply_view(shared, view)
                    if on_view is not None:
                        on_view(before)
                    if view.memory_round:
                        # Read in a worker thread: 183-193 ms of Python steps at 60 000 endpoints (timed alone),
                        # which would stall this picker's event loop (its requests) meanwhile.
                        shared.free.capacity = await asyncio.to_thread(view_capacities, view)
                        if on_samples is not None:
                            baseline, samples = await asyncio.to_thread(memory_of, view, inflight.now())
                            shared.free.rebase(baseline)
                            on_samples(samples)
                    VIEWS.labels("received").inc()
                    delay = backoff_s
            lost("the control plane ended the stream")
        except grpc.aio.AioRpcError as err:
            lost(f"{err.code().name}: {err.details()}")
        await asyncio.sleep(delay)
        delay = min(max_backoff_s, delay * 2)
