"""The ``inferlb.v1.LoadViewService`` server: pickers report their live load; each report is answered,
and pushed to every other picker's stream, as the sum over every live picker
(:class:`~xds_server.loadview.table.LoadTable`).

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
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import Counter, Gauge

from protos import load_view_pb2, load_view_pb2_grpc
from xds_server.loadview.grants import GrantLedger
from xds_server.loadview.rounds import RoundCounts
from xds_server.loadview.table import ClusterLoad, Load, LoadTable, Report, Totals

__all__ = ["LoadViewServicer", "add_load_view_servicer", "memory_message", "report_from", "view_message"]

log = logging.getLogger(__name__)

REPORTS = Counter("inferlb_load_view_reports_total", "Picker load reports received, by outcome", ["outcome"])
PICKERS = Gauge("inferlb_load_view_pickers", "Pickers whose load reports are in the shared load view now")
GRANTS = Counter("inferlb_load_view_grants_total", "Memory grant requests from pickers, by outcome "
                 "(granted, refused: the other pickers' grants their view did not show leave too little room)",
                 ["outcome"])
#: Views per stream whose grant snapshot is kept for the picker to name (it names its latest).
VIEWS_KEPT = 64


def _number(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value}")
    return value


def _numbers(values: list[float], what: str) -> None:
    """Every value finite and >= 0, else ValueError naming ``what`` and the first bad one."""
    if not all(0 <= v < math.inf for v in values):  # NaN fails the comparison too
        _number(next(v for v in values if not 0 <= v < math.inf), what)


def report_from(msg: load_view_pb2.LoadReport) -> Report:
    """The :class:`Report` of one ``LoadReport`` message.

    Raises:
        ValueError: no ``picker``, an endpoint without cluster or endpoint, or a negative or
            non-finite number (the message names the field).
    """
    if not msg.picker:
        raise ValueError("LoadReport.picker is empty")
    endpoints: dict[tuple[str, str], Load] = {}
    for e in msg.endpoints:
        if not e.cluster or not e.endpoint:
            raise ValueError("LoadReport.endpoints[].cluster and .endpoint must be set")
        where = f"LoadReport.endpoints[{e.cluster}/{e.endpoint}]"
        load = Load(_number(e.in_flight, f"{where}.in_flight"), _number(e.work, f"{where}.work"),
                    _number(e.memory_mib, f"{where}.memory_mib"), _number(e.tokens, f"{where}.tokens"),
                    _number(e.picks, f"{where}.picks"))
        key = (e.cluster, e.endpoint)
        have = endpoints.get(key)
        endpoints[key] = load if have is None else have + load
    clusters: dict[str, ClusterLoad] = {}
    for c in msg.clusters:
        if not c.cluster:
            raise ValueError("LoadReport.clusters[].cluster must be set")
        cl = ClusterLoad(_number(c.in_flight, f"LoadReport.clusters[{c.cluster}].in_flight"),
                         _number(c.work, f"LoadReport.clusters[{c.cluster}].work"))
        have_c = clusters.get(c.cluster)
        clusters[c.cluster] = cl if have_c is None else have_c + cl
    finished: list[tuple[str, float, float]] = []
    for f in msg.finished:
        if not f.endpoint:
            raise ValueError("LoadReport.finished[].endpoint must be set")
        where = f"LoadReport.finished[{f.endpoint}]"
        ages, mibs = list(f.picked_age_s), list(f.memory_mib)
        if len(ages) != len(mibs):
            raise ValueError(f"{where}: {len(mibs)} memory_mib against {len(ages)} picked_age_s (one each per request)")
        _numbers(ages, f"{where}.picked_age_s")
        _numbers(mibs, f"{where}.memory_mib")
        finished.extend(zip([f.endpoint] * len(ages), ages, mibs, strict=True))
    return Report(msg.picker, msg.seq, endpoints, clusters, tuple(finished), msg.grants_applied)


def grant_requests(msg: load_view_pb2.LoadReport) -> list[tuple[int, str, float, float]]:
    """``[(id, endpoint, MiB, room MiB)]`` of a report's grant requests.

    Raises:
        ValueError: a request without an endpoint, or a need that is negative or not finite, or a
            room that is not finite (the message names the field).
    """
    out = []
    for g in msg.grant_requests:
        if not g.endpoint:
            raise ValueError("LoadReport.grant_requests[].endpoint must be set")
        if not math.isfinite(g.room_mib):
            raise ValueError(f"LoadReport.grant_requests[{g.id}].room_mib must be finite, got {g.room_mib}")
        out.append((g.id, g.endpoint, _number(g.memory_mib, f"LoadReport.grant_requests[{g.id}].memory_mib"),
                    g.room_mib))
    return out


def _endpoints(loads) -> list[load_view_pb2.EndpointLoad]:
    return [load_view_pb2.EndpointLoad(cluster=c, endpoint=e, in_flight=v.in_flight, work=v.work,
                                       memory_mib=v.memory_mib, tokens=v.tokens, picks=v.picks)
            for (c, e), v in loads.items()]


def _clusters(loads) -> list[load_view_pb2.ClusterLoad]:
    return [load_view_pb2.ClusterLoad(cluster=c, in_flight=v.in_flight, work=v.work) for c, v in loads.items()]


def view_message(totals: Totals, own: Report | None, seq: int, idle_others: int = 0, view: int = 0,
                 grants: list[tuple[int, int, float]] | None = None) -> load_view_pb2.LoadView:
    """The ``LoadView`` for one picker: ``totals`` and the picker's own report as counted in them
    (``own`` None: the picker is not in the sum); ``idle_others``:
    :meth:`~xds_server.loadview.table.LoadTable.idle_others`; ``view``: this view's number on its
    stream; ``grants``: ``[(request id, grant number or 0, unseen MiB)]`` answers to the picker's
    grant requests. A round's memory samples go in with :func:`memory_message`."""
    msg = load_view_pb2.LoadView(seq=seq, pickers=totals.pickers, endpoints=_endpoints(totals.endpoints),
                                 clusters=_clusters(totals.clusters), idle_others=idle_others, view=view)
    if grants:
        msg.grants.extend(load_view_pb2.GrantAnswer(id=i, grant=g, unseen_mib=u) for i, g, u in grants)
    if own is not None:
        msg.own_endpoints.extend(_endpoints(own.endpoints))
        msg.own_clusters.extend(_clusters(own.clusters))
    return msg


def memory_message(counts: RoundCounts, picker: str | None, now: float) -> load_view_pb2.LoadView:
    """A ``LoadView`` holding only the memory round of ``counts`` as ``picker`` gets it (the others'
    share of each sample, :meth:`~xds_server.loadview.rounds.RoundCounts.others`), the samples' ages
    told at ``now`` (monotonic s): merge it into the view, whose ``memory_age_s`` says how long
    after ``now`` it went out. Pure, and reads nothing the event loop changes: built in a worker
    thread (~80 ms of CPU at 60 000 endpoints)."""
    others, capacities = counts.others(picker), counts.capacities
    msg = load_view_pb2.LoadView(memory_round=counts.round)
    msg.memory.extend(load_view_pb2.MemorySample(endpoint=e, free_mib=free, age_s=max(0.0, now - at),
                                                 others_mib=others.get(e, 0.0), capacity_mib=capacities.get(e, 0.0))
                      for e, (free, at) in counts.samples.items())
    return msg


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
        stream = _Stream()
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
                    totals = table.totals(now)
                    own = table.report(stream.picker) if stream.picker is not None else None
                    stream.views += 1
                    stream.seen[stream.views] = table.grants_seen()
                    if len(stream.seen) > VIEWS_KEPT:
                        del stream.seen[next(iter(stream.seen))]
                    answers, stream.answers = stream.answers, []
                    msg = view_message(totals, own, own.seq if own is not None else stream.seq,
                                       table.idle_others(stream.picker, now), stream.views, answers)
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
            mine = stream.mine
            if mine is not None and table.report(mine.picker) is mine:  # not taken over by a new stream
                table.forget(mine.picker)
                PICKERS.set(table.totals(self._clock()).pickers)
                self._wake_all()

    async def _read(self, request_iterator: AsyncIterator[load_view_pb2.LoadReport],
                    context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        """Records every report of one stream; wakes every stream (this one's view is its answer)."""
        async for msg in request_iterator:
            try:
                report = report_from(msg)
                asks = grant_requests(msg)
            except ValueError as err:
                REPORTS.labels("rejected").inc()
                log.warning("load view: refused a report from %s: %s", context.peer(), err)
                continue
            now = self._clock()
            self.table.record(report, now)
            if asks:
                self._grant(report.picker, asks, msg.view_applied, stream, now)
            REPORTS.labels("accepted").inc()
            own = self.table.report(report.picker)
            if own is report:
                stream.mine = report
            stream.picker, stream.seq = report.picker, report.seq
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

    def _grant(self, picker: str, asks: list[tuple[int, str, float, float]], view_applied: int,
               stream: _Stream, now: float) -> None:
        """Decide one report's grant requests on what view ``view_applied`` showed; queue the answers."""
        for view in [v for v in stream.seen if v < view_applied]:
            del stream.seen[view]
        seen = stream.seen.get(view_applied, {})
        for request_id, endpoint, mib, room in asks:
            number, unseen = self.ledger.decide(picker, endpoint, mib, room, seen, now)
            GRANTS.labels("granted" if number else "refused").inc()
            stream.answers.append((request_id, number, unseen))

    def _wake_all(self) -> None:
        for w in self._wakes:
            w.set()


class _Stream:
    """One Share stream's picker: its name and latest seq (None before its first good report), its
    report as kept in the table (``mine``), the views sent (``views``) with what each showed of the
    grants (``seen``: ``{view: LoadTable.grants_seen()}``, the latest :data:`VIEWS_KEPT`), and the
    grant answers for the next view."""

    __slots__ = ("answers", "mine", "picker", "seen", "seq", "views")

    def __init__(self) -> None:
        self.mine: Report | None = None
        self.picker: str | None = None
        self.seq: int | None = None
        self.views = 0
        self.seen: dict[int, dict[str, int]] = {}
        self.answers: list[tuple[int, int, float]] = []


def add_load_view_servicer(table: LoadTable) -> Callable[[grpc.aio.Server], None]:
    """A hook that adds the load-view service over ``table`` to a gRPC server (before it starts)."""
    def add(server: grpc.aio.Server) -> None:
        load_view_pb2_grpc.add_LoadViewServiceServicer_to_server(LoadViewServicer(table), server)
    return add
