"""The ``inferlb.v1.LoadViewService`` server: pickers report their live load; each report is answered,
and pushed to every other picker's stream, as the sum over every live picker
(:class:`~xds_server.loadview.table.LoadTable`).

The decisions are :mod:`xds_server.loadview.exchange`'s (pure: a report taken, a view built, a stream
ended); this module is their asyncio and gRPC shell (streams, wake-ups, the worker thread, counters).
Served on the xDS gRPC server (a standalone picker already knows that address). Bad input (a
negative or non-finite number, no picker name) is refused per report: counted, logged, the stream
goes on with the picker's last good report. A picker counts from its first report until its stream
ends or its last report is older than the table's expiry.

The slow loop's memory samples go out once their baselines can be told: :data:`~xds_server.loadview.rounds.FINISH_LAG_S`
after the newest was taken (:attr:`LoadTable.memory_ready_at`); until then views carry none. A ready
round is counted, and each stream's part of it built, in a worker thread: the views meanwhile go out
without it (a view, and the grant answers in it, does not wait for a count), the part in the next.

Memory grants (:mod:`xds_server.loadview.grants`): a report's ``grant_requests`` are decided when
the report is read, on what the view the picker applied last (``LoadReport.view_applied``) showed
of the other pickers' grants, and answered in the next view on its stream. A view number the
stream does not know (none applied yet, or too old) shows no grant: every recent grant to another
picker counts against the room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import Counter, Gauge

from protos import load_view_pb2, load_view_pb2_grpc
from xds_server.loadview.exchange import Stream, end_stream, memory_message, next_view, take_report
from xds_server.loadview.grants import GrantLedger
from xds_server.loadview.rounds import RoundCounts
from xds_server.loadview.table import LoadTable

__all__ = ["LoadViewServicer", "add_load_view_servicer"]

log = logging.getLogger(__name__)

REPORTS = Counter("inferlb_load_view_reports_total", "Picker load reports received, by outcome", ["outcome"])
PICKERS = Gauge("inferlb_load_view_pickers", "Pickers whose load reports are in the shared load view now")
GRANTS = Counter("inferlb_load_view_grants_total", "Memory grant requests from pickers, by outcome "
                 "(granted, refused: the other pickers' grants their view did not show leave too little room)",
                 ["outcome"])

class LoadViewServicer(load_view_pb2_grpc.LoadViewServiceServicer):
    """Keeps the pickers' reports in ``table`` and sends every picker the view of now whenever any
    picker's report arrives (its own answers its report; the others' are pushed): a picker learns
    another's picks one report and one push after they happened, not at its own next report.

    Views to one stream are coalesced: reports arriving while a view is being sent make one more
    view, not one each. ``ledger``: where memory grants are decided (default: one keeping grants
    for the table's expiry). ``clock``: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, table: LoadTable, ledger: GrantLedger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.ledger = ledger if ledger is not None else GrantLedger(table.expiry_s)
        self._clock = clock
        self._wakes: set[asyncio.Event] = set()
        self._counting: asyncio.Future | None = None  # the memory round being counted
        # One thread for the memory rounds' counts and messages: CPU-bound threads side by side
        # would take the GIL from the event loop in turn, each for a switch interval.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="load-view-memory")

    async def Share(self, request_iterator: AsyncIterator[load_view_pb2.LoadReport],  # noqa: N802 (gRPC name)
                    context: grpc.aio.ServicerContext) -> AsyncIterator[load_view_pb2.LoadView]:
        table = self.table
        wake = asyncio.Event()
        stream = Stream()
        self._wakes.add(wake)
        reader = asyncio.ensure_future(self._read(request_iterator, context, stream))
        sent_round = held_round = 0
        building: asyncio.Future | None = None   # this stream's memory part of a round, being built
        try:
            while True:
                waiter = asyncio.ensure_future(wake.wait())
                await asyncio.wait((reader, waiter), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if wake.is_set():
                    wake.clear()
                    if stream.seq is None:
                        continue   # others reported before this stream's first report: nothing to answer yet
                    memory = None
                    if building is not None and building.done():
                        part, building = building.result(), None   # a failed count ends the stream
                        if part is not None and part[0].memory_round > sent_round:
                            (memory, told), sent_round = part, part[0].memory_round
                    now = self._clock()
                    if building is None and table.memory_round != sent_round and now >= table.memory_ready_at:
                        # Counted and built off the loop; this view goes out now (with the grant
                        # answers), the round's part in the view after it is built.
                        building = asyncio.ensure_future(self._memory_part(stream.picker, sent_round))
                        building.add_done_callback(lambda _: wake.set())
                    if (building is None and table.memory_round != sent_round and now < table.memory_ready_at
                            and held_round != table.memory_round):
                        # A sample younger than FINISH_LAG_S: the others' finished requests that it
                        # shows free are not all reported yet, and its baseline would credit them twice.
                        held_round = table.memory_round
                        asyncio.get_running_loop().call_later(table.memory_ready_at - now, wake.set)
                    msg = next_view(table, stream, now)
                    assert msg is not None  # the stream has had a good report
                    if memory is not None:
                        msg.MergeFrom(memory)
                        msg.memory_age_s = max(0.0, self._clock() - told)
                    yield msg
                elif reader.done():
                    reader.result()   # a broken stream raises here
                    return
        finally:
            self._wakes.discard(wake)
            reader.cancel()
            if building is not None:
                building.cancel()
            if end_stream(table, stream):  # not taken over by a new stream
                PICKERS.set(table.totals(self._clock()).pickers)
                self._wake_all()

    async def _read(self, request_iterator: AsyncIterator[load_view_pb2.LoadReport],
                    context: grpc.aio.ServicerContext, stream: Stream) -> None:
        """Records every report of one stream; wakes every stream (this one's view is its answer)."""
        async for msg in request_iterator:
            now = self._clock()
            try:
                answers = take_report(self.table, self.ledger, stream, msg, now)
            except ValueError as err:
                REPORTS.labels("rejected").inc()
                log.warning("load view: refused a report from %s: %s", context.peer(), err)
                continue
            for _, number, _ in answers:
                GRANTS.labels("granted" if number else "refused").inc()
            REPORTS.labels("accepted").inc()
            PICKERS.set(self.table.totals(now).pickers)
            self._wake_all()

    async def _memory_part(self, picker: str | None, sent_round: int) -> tuple[load_view_pb2.LoadView, float] | None:
        """``picker``'s part of the latest ready memory round (:func:`memory_message`) and when its
        ages were told (monotonic s), built in the worker thread; None: no round newer than
        ``sent_round`` is counted."""
        counts = await self._round_counts()   # the latest ready round (a newer one may be waiting)
        if counts.round <= sent_round:
            return None
        told = self._clock()
        memory = await asyncio.get_running_loop().run_in_executor(self._worker, memory_message, counts, picker, told)
        return memory, told

    async def _round_counts(self) -> RoundCounts:
        """The table's latest memory round that is ready (:attr:`LoadTable.memory_ready_at`), counted in a
        worker thread: one count at a time, shared by every stream waiting for it; a round that came
        during a count is counted next once it is ready (until then: the round counted before it)."""
        table = self.table
        while table.counted.round != table.memory_round and self._clock() >= table.memory_ready_at:
            if self._counting is None:
                self._counting = asyncio.ensure_future(self._count())
            await asyncio.shield(self._counting)
        return table.counted

    async def _count(self) -> None:
        try:
            if self._clock() < self.table.memory_ready_at:
                return   # a round came that is not ready: its reports are not all in
            count = self.table.round_counter()
            self.table.take_counts(await asyncio.get_running_loop().run_in_executor(self._worker, count))
        finally:
            self._counting = None

    def _wake_all(self) -> None:
        for w in self._wakes:
            w.set()


def add_load_view_servicer(table: LoadTable) -> Callable[[grpc.aio.Server], None]:
    """A hook that adds the load-view service over ``table`` to a gRPC server (before it starts)."""
    def add(server: grpc.aio.Server) -> None:
        load_view_pb2_grpc.add_LoadViewServiceServicer_to_server(LoadViewServicer(table), server)
    return add
