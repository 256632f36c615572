"""One picker's exchange with the shared load view, without its I/O (pure: messages in, messages out;
the clock is passed in).

The load-view service (:mod:`xds_server.loadview.service`) is an asyncio gRPC shell around these
functions; the policy lab (``bench/lab/loadview.py``) drives the same functions in virtual time.
Per ``Share`` stream (one per picker):

- :func:`take_report`: a ``LoadReport`` is checked (:func:`report_from`, :func:`grant_requests`),
  kept in the :class:`~xds_server.loadview.table.LoadTable` (its sum over every live picker), and its
  memory grant requests are decided by the :class:`~xds_server.loadview.grants.GrantLedger` on what
  the view the picker applied last (``LoadReport.view_applied``) showed of the other pickers' grants;
  the answers wait on the stream for its next view.
- :func:`next_view`: the ``LoadView`` of now for the stream's picker (the table's sum, its own share
  of it, the grant answers), numbered on the stream, with what it shows of the grants remembered
  (the latest :data:`VIEWS_KEPT`) for the picker's next grant requests to name.
- :func:`end_stream`: the stream ended: its picker leaves the sum (unless a newer stream took over).

A memory round's part of a view (:func:`memory_message`) is built apart: the service builds it in a
worker thread and merges it into the view after.
"""

from __future__ import annotations

import math

from protos import load_view_pb2
from xds_server.loadview.grants import GrantLedger
from xds_server.loadview.rounds import RoundCounts
from xds_server.loadview.table import ClusterLoad, Load, LoadTable, Report, Totals

__all__ = ["VIEWS_KEPT", "Stream", "end_stream", "grant_requests", "memory_message", "next_view", "report_from",
           "take_report", "view_message"]

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
    waiting = tuple((w.id, w.cluster, _number(w.memory_mib, f"LoadReport.waiting[{w.id}].memory_mib"),
                     _number(w.waited_s, f"LoadReport.waiting[{w.id}].waited_s")) for w in msg.waiting)
    return Report(msg.picker, msg.seq, endpoints, clusters, tuple(finished), msg.grants_applied, waiting)


def grant_requests(msg: load_view_pb2.LoadReport) -> list[tuple[int, str, float, float, str, float]]:
    """``[(id, endpoint, MiB, room MiB, cluster, waited s)]`` of a report's grant requests.

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
                    g.room_mib, g.cluster, _number(g.waited_s, f"LoadReport.grant_requests[{g.id}].waited_s")))
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
    share of each sample, :meth:`~xds_server.loadview.rounds.RoundCounts.others`; its own share of the
    backends' held counts, :meth:`~xds_server.loadview.rounds.RoundCounts.own_held`), the samples' ages
    told at ``now`` (monotonic s): merge it into the view, whose ``memory_age_s`` says how long
    after ``now`` it went out. Pure, and reads nothing the event loop changes: built in a worker
    thread (~80 ms of CPU at 60 000 endpoints)."""
    others, capacities, held = counts.others(picker), counts.capacities, counts.own_held(picker)
    msg = load_view_pb2.LoadView(memory_round=counts.round)
    msg.memory.extend(load_view_pb2.MemorySample(endpoint=e, free_mib=free, age_s=max(0.0, now - at),
                                                 others_mib=others.get(e, 0.0), capacity_mib=capacities.get(e, 0.0),
                                                 held=held.get(e))
                      for e, (free, at) in counts.samples.items())
    return msg


class Stream:
    """One ``Share`` stream's state.

    Attributes:
        picker: its picker's name; ``seq``: the latest report's ``seq`` (both None before its first
            good report).
        mine: its report as kept in the table (None: none yet).
        views: views sent so far (the last one's number).
        seen: ``{view number: LoadTable.grants_seen() when it was built}``, the latest :data:`VIEWS_KEPT`.
        answers: ``[(request id, grant number or 0, unseen MiB)]`` for the next view.
    """

    __slots__ = ("answers", "mine", "picker", "seen", "seq", "views")

    def __init__(self) -> None:
        self.mine: Report | None = None
        self.picker: str | None = None
        self.seq: int | None = None
        self.views = 0
        self.seen: dict[int, dict[str, int]] = {}
        self.answers: list[tuple[int, int, float]] = []


def take_report(table: LoadTable, ledger: GrantLedger, stream: Stream, msg: load_view_pb2.LoadReport,
                now: float) -> list[tuple[int, int, float]]:
    """Keep one report of ``stream`` in ``table`` from ``now`` (monotonic s) and decide its grant requests
    with ``ledger`` on what the view it names (``view_applied``) showed of the other pickers' grants (a
    view the stream does not know, none applied yet or too old, shows none: every recent grant to
    another picker counts against the room). The answers are queued for the stream's next view.

    Returns:
        The answers ``[(request id, grant number or 0, unseen MiB)]`` (empty without requests).

    Raises:
        ValueError: a bad report (:func:`report_from`, :func:`grant_requests`): nothing is kept.
    """
    report = report_from(msg)
    asks = grant_requests(msg)
    table.record(report, now)
    answers = []
    if asks:
        view_applied = msg.view_applied
        for view in [v for v in stream.seen if v < view_applied]:
            del stream.seen[view]
        seen = stream.seen.get(view_applied, {})
        waiters = table.waiters(report.picker, now)
        for request_id, endpoint, mib, room, cluster, waited in asks:
            number, unseen = ledger.decide(report.picker, endpoint, mib, room, seen, now,
                                           cluster, waited, waiters)
            answers.append((request_id, number, unseen))
        stream.answers.extend(answers)
    if table.report(report.picker) is report:
        stream.mine = report
    stream.picker, stream.seq = report.picker, report.seq
    return answers


def next_view(table: LoadTable, stream: Stream, now: float) -> load_view_pb2.LoadView | None:
    """The view of now (monotonic s) for ``stream``'s picker, numbered on the stream, with the grant
    answers waiting for it (taken); None before the stream's first good report (nothing to answer).
    What it shows of the grants is remembered for the picker's grant requests that name it."""
    if stream.seq is None:
        return None
    totals = table.totals(now)
    own = table.report(stream.picker) if stream.picker is not None else None
    stream.views += 1
    stream.seen[stream.views] = table.grants_seen()
    if len(stream.seen) > VIEWS_KEPT:
        del stream.seen[next(iter(stream.seen))]
    answers, stream.answers = stream.answers, []
    return view_message(totals, own, own.seq if own is not None else stream.seq,
                        table.idle_others(stream.picker, now), stream.views, answers)


def end_stream(table: LoadTable, stream: Stream) -> bool:
    """``stream`` ended: its picker leaves ``table``'s sum at once, unless a newer stream's report
    replaced the one it kept. Returns True when the picker left."""
    mine = stream.mine
    if mine is not None and table.report(mine.picker) is mine:
        table.forget(mine.picker)
        return True
    return False
