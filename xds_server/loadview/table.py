"""The sum of every picker's live load, with expiry (pure: data in, data out; the clock is passed in).

Each picker (one per Envoy) reports its whole live load about every 100 ms (not a delta, so a lost
report costs nothing but freshness). The table keeps each picker's latest report with its receive
time; the view is the sum over the pickers whose report is younger than ``expiry_s`` (a picker
that dies, or whose stream hangs, stops counting within that bound; a stream that ends is forgotten
at once). The sum is kept up to date incrementally: a new report takes its picker's previous one
out and adds itself, O(the report's entries), so the cost per report does not grow with the number
of pickers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.loadview.rounds import FINISH_LAG_S, HISTORY_S, RoundCounts, count_round

__all__ = ["ClusterLoad", "Load", "LoadTable", "Report", "Totals", "alive"]


@dataclass(frozen=True, slots=True)
class Load:
    """Live load on one endpoint of one cluster: requests in flight, their predicted work (typical
    requests), GPU memory (MiB), tokens (prompt + output), and picks since the previous report."""

    in_flight: float = 0.0
    work: float = 0.0
    memory_mib: float = 0.0
    tokens: float = 0.0
    picks: float = 0.0

    def __add__(self, other: Load) -> Load:
        return Load(self.in_flight + other.in_flight, self.work + other.work, self.memory_mib + other.memory_mib,
                    self.tokens + other.tokens, self.picks + other.picks)

    def __sub__(self, other: Load) -> Load:
        return Load(self.in_flight - other.in_flight, self.work - other.work, self.memory_mib - other.memory_mib,
                    self.tokens - other.tokens, self.picks - other.picks)

    @property
    def empty(self) -> bool:
        """Nothing left (below rounding noise): the entry can go."""
        return max(abs(self.in_flight), abs(self.work), abs(self.memory_mib), abs(self.tokens), abs(self.picks)) < 1e-6


@dataclass(frozen=True, slots=True)
class ClusterLoad:
    """Requests in flight to one cluster (pinned or not) and their work."""

    in_flight: float = 0.0
    work: float = 0.0

    def __add__(self, other: ClusterLoad) -> ClusterLoad:
        return ClusterLoad(self.in_flight + other.in_flight, self.work + other.work)

    def __sub__(self, other: ClusterLoad) -> ClusterLoad:
        return ClusterLoad(self.in_flight - other.in_flight, self.work - other.work)

    @property
    def empty(self) -> bool:
        """Nothing left (below rounding noise)."""
        return max(abs(self.in_flight), abs(self.work)) < 1e-6


_NO_ENDPOINTS: Mapping[tuple[str, str], Load] = MappingProxyType({})
_NO_CLUSTERS: Mapping[str, ClusterLoad] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Report:
    """One picker's whole live load: ``endpoints[(cluster, "HOST:PORT")]`` and ``clusters[cluster]``.

    ``picker``: who reports (unique per picker process); ``seq``: increases with every report;
    ``finished``: ``("HOST:PORT", picked how long before the report (s), MiB)`` of each of the
    picker's requests with memory finished since its previous report; ``grants_applied``: the
    largest memory grant number (:mod:`xds_server.loadview.grants`) whose request the report counts;
    ``waiting``: its memory queue.
    """

    picker: str
    seq: int = 0
    endpoints: Mapping[tuple[str, str], Load] = field(default_factory=lambda: _NO_ENDPOINTS)
    clusters: Mapping[str, ClusterLoad] = field(default_factory=lambda: _NO_CLUSTERS)
    finished: tuple[tuple[str, float, float], ...] = ()
    grants_applied: int = 0
    waiting: tuple[tuple[int, str, float, float], ...] = ()
    """``(id, cluster, MiB, waited s when sent)`` of each request in the picker's memory queue, oldest first."""


@dataclass(frozen=True, slots=True)
class Totals:
    """The sum of some reports: per (cluster, endpoint), per cluster, and how many pickers."""

    endpoints: Mapping[tuple[str, str], Load]
    clusters: Mapping[str, ClusterLoad]
    pickers: int


_NO_LOAD = Load()
_NO_CLUSTER_LOAD = ClusterLoad()


def alive(received: Mapping[str, float], now: float, expiry_s: float) -> set[str]:
    """The pickers whose last report (``received[picker]``, monotonic s) is younger than ``expiry_s``.

    >>> sorted(alive({"a": 9.5, "b": 8.0, "c": 10.0}, now=10.0, expiry_s=1.0))
    ['a', 'c']
    """
    limit = now - expiry_s
    return {p for p, at in received.items() if at > limit}


class LoadTable:
    """Every picker's latest report and the sum of the live ones.

    Args:
        expiry_s: a picker whose last report is older than this stops counting (s, > 0). Choose
            several report intervals (default 1 s = ten 100 ms reports).

    Raises:
        ValueError: ``expiry_s`` is not positive.
    """

    def __init__(self, expiry_s: float = 1.0) -> None:
        if expiry_s <= 0:
            raise ValueError(f"load view expiry_s must be > 0, got {expiry_s}")
        self.expiry_s = expiry_s
        self._reports: dict[str, Report] = {}
        self._received: dict[str, float] = {}
        self._endpoints: dict[tuple[str, str], Load] = {}
        self._clusters: dict[str, ClusterLoad] = {}
        self._endpoints_view = MappingProxyType(self._endpoints)
        self._clusters_view = MappingProxyType(self._clusters)
        self.memory: Mapping[str, tuple[float, float]] = MappingProxyType({})
        """The slow loop's latest samples: ``{"HOST:PORT": (free GPU memory MiB, taken at, monotonic s)}``."""
        self.held: Mapping[str, float] | None = None
        """The backends' held requests in the latest samples (:meth:`set_memory`; None: not read)."""
        self.memory_round = 0
        """Increases with every :meth:`set_memory` (0: none yet)."""
        self.memory_ready_at = 0.0
        """When the latest samples' baselines can be told (monotonic s): :data:`FINISH_LAG_S` after
        the newest of them was taken (:meth:`round_counter` reads the reports up to then)."""
        # picker -> (received, {endpoint: MiB in flight}, [(endpoint, picked at, MiB) finished since the report before],
        #            {endpoint: (requests in flight, picks since the report before)}): rounds.History
        self._mib: dict[str, deque[tuple[float, dict[str, float], list[tuple[str, float, float]],
                                         dict[str, tuple[float, float]]]]] = {}
        self._busy: dict[str, float] = {}  # picker -> when its last report with picks or requests in flight came
        self._with_memory: dict[str, float] = {}  # endpoint -> when a report last had memory there (s)
        self._implied: dict[str, deque[float]] = {}  # endpoint -> implied capacities of its last rounds (MiB)
        self.counted = RoundCounts()
        """The last memory round counted (:meth:`take_counts`)."""

    def set_memory(self, samples: Mapping[str, tuple[float, float]], held: Mapping[str, float] | None = None) -> None:
        """Take the slow loop's memory samples of one round (passed on to every picker with the view,
        from :attr:`memory_ready_at` on), with ``held``: ``{"HOST:PORT": requests the backend held in
        the same sample}`` where the slow loop reads them (``picker.memory_count_in_sample``; None: not
        read), each picker's share of which goes with its samples (:meth:`RoundCounts.own_held
        <xds_server.loadview.rounds.RoundCounts.own_held>`)."""
        self.memory = MappingProxyType(dict(samples))
        self.held = None if held is None else MappingProxyType(dict(held))
        self.memory_round += 1
        self.memory_ready_at = max((at for _, at in self.memory.values()), default=0.0) + FINISH_LAG_S

    def record(self, report: Report, now: float) -> None:
        """Keep ``report`` as its picker's load from ``now`` (monotonic s); an older ``seq`` than the
        one kept (a reordered or replayed report) is ignored."""
        kept = self._reports.get(report.picker)
        if kept is not None and report.seq < kept.seq:
            return
        if kept is not None:
            self._apply(kept, -1)
        self._apply(report, +1)
        self._reports[report.picker] = report
        self._received[report.picker] = now
        if (any(cl.in_flight > 0 for cl in report.clusters.values())
                or any(load.picks > 0 or load.in_flight > 0 for load in report.endpoints.values())):
            self._busy[report.picker] = now
        mib: dict[str, float] = {}
        counts: dict[str, tuple[float, float]] = {}
        for (_, endpoint), load in report.endpoints.items():
            mib[endpoint] = mib.get(endpoint, 0.0) + load.memory_mib
            n, picks = counts.get(endpoint, (0.0, 0.0))
            counts[endpoint] = (n + load.in_flight, picks + load.picks)
        for endpoint in [*(e for e, m in mib.items() if m > 0), *(f[0] for f in report.finished)]:
            self._with_memory[endpoint] = now
        history = self._mib.setdefault(report.picker, deque())
        history.append((now, mib, [(e, now - age, m) for e, age, m in report.finished], counts))
        while len(history) > 1 and history[1][0] < now - HISTORY_S:
            history.popleft()

    def forget(self, picker: str) -> None:
        """Stop counting ``picker`` at once (its stream ended)."""
        kept = self._reports.pop(picker, None)
        if kept is not None:
            del self._received[picker]
            self._mib.pop(picker, None)
            self._busy.pop(picker, None)
            self._apply(kept, -1)

    def idle_others(self, picker: str | None, now: float) -> int:
        """Pickers in the sum other than ``picker`` that neither picked nor had a request in flight
        in their reports of the last ``expiry_s`` (``now``: monotonic s): an Envoy sends them no
        traffic (e.g. the control plane's own picker beside standalone ones), so they decide nothing
        and another picker's changes are no news to them."""
        limit = now - self.expiry_s
        return sum(1 for p in self._reports if p != picker and self._busy.get(p, limit) <= limit)

    def round_counter(self) -> Callable[[], tuple[RoundCounts, list[tuple[str, float]]]]:
        """The latest memory round's counting (:func:`~xds_server.loadview.rounds.count_round`) over a
        snapshot of the reports taken now, as a callable for a worker thread: a copy of each picker's
        list of kept reports and of the endpoints with memory (O(pickers x reports kept) here, the
        rest there). Hand its result to :meth:`take_counts`; one at a time (it updates the capacity
        rounds). Call it once the round is ready (:attr:`memory_ready_at`): the reports it reads are
        all in by then.
        """
        round_, samples, implied, held_counts = self.memory_round, self.memory, self._implied, self.held
        histories = {picker: list(history) for picker, history in self._mib.items()}
        with_memory = dict(self._with_memory)
        limit = max(self._received.values(), default=0.0) - HISTORY_S

        def count() -> tuple[RoundCounts, list[tuple[str, float]]]:
            stale = [(e, at) for e, at in with_memory.items() if at < limit]
            active = with_memory.keys() - {e for e, _ in stale}
            return count_round(round_, samples, histories, active, implied, held_counts), stale

        return count

    def take_counts(self, counted: tuple[RoundCounts, list[tuple[str, float]]]) -> None:
        """Keep a :meth:`round_counter` result as :attr:`counted` and forget the endpoints it found
        without memory reported in the last :data:`~xds_server.loadview.rounds.HISTORY_S` (unless
        reported since)."""
        counts, stale = counted
        with_memory = self._with_memory
        for endpoint, at in stale:
            if with_memory.get(endpoint) == at:
                del with_memory[endpoint]
        self.counted = counts

    def _apply(self, report: Report, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) one report's loads from the running sums."""
        _accumulate(self._endpoints, report.endpoints, sign, _NO_LOAD)
        _accumulate(self._clusters, report.clusters, sign, _NO_CLUSTER_LOAD)

    def totals(self, now: float) -> Totals:
        """The sum over the pickers alive at ``now`` (expired ones are dropped here). Its maps are
        read-only views of the running sums: read them before the next :meth:`record`."""
        live = alive(self._received, now, self.expiry_s)
        if len(live) != len(self._received):
            for picker in [p for p in self._received if p not in live]:
                self.forget(picker)
        return Totals(self._endpoints_view, self._clusters_view, len(self._reports))

    def grants_seen(self) -> dict[str, int]:
        """``{picker: Report.grants_applied}`` of the reports in the sum now: what a view built now
        shows of the memory grants (:meth:`~xds_server.loadview.grants.GrantLedger.decide`)."""
        return {p: r.grants_applied for p, r in self._reports.items() if r.grants_applied}

    def report(self, picker: str) -> Report | None:
        """``picker``'s kept report (None: none, or forgotten)."""
        return self._reports.get(picker)

    def waiters(self, picker: str, now: float) -> list[tuple[str, int, str, float, float]]:
        """The requests waiting in the memory queues of the live pickers other than ``picker``, as their
        kept reports tell: ``[(picker, id, cluster, MiB, waited s by now)]`` (``now``: monotonic s).
        O(pickers + their waiters)."""
        limit = now - self.expiry_s
        out = []
        for name, report in self._reports.items():
            received = self._received[name]
            if name != picker and report.waiting and received > limit:
                out += [(name, i, c, mib, waited + now - received) for i, c, mib, waited in report.waiting]
        return out

    def shares(self, now: float) -> dict:
        """The admin document: each live picker's report, its age and its share of the requests in
        flight (0-1), with the totals. Shape: ``{"pickers": [{"picker", "seq", "age_s", "share",
        "in_flight", "endpoints": [{"cluster", "endpoint", "in_flight", "work", "memory_mib",
        "tokens", "picks", "share"}]}], "endpoints": [...same without share...], "expiry_s"}``."""
        totals = self.totals(now)
        all_in_flight = sum(cl.in_flight for cl in totals.clusters.values())
        pickers = []
        for name in sorted(self._reports):
            r = self._reports[name]
            mine = sum(cl.in_flight for cl in r.clusters.values())
            pickers.append({
                "picker": name, "seq": r.seq, "age_s": round(max(0.0, now - self._received[name]), 3),
                "in_flight": mine, "share": round(mine / all_in_flight, 4) if all_in_flight > 0 else 0.0,
                "endpoints": [_row(key, load, totals.endpoints.get(key)) for key, load in sorted(r.endpoints.items())],
            })
        return {"expiry_s": self.expiry_s, "pickers": pickers,
                "endpoints": [_row(key, load) for key, load in sorted(totals.endpoints.items())]}


def _row(key: tuple[str, str], load: Load, total: Load | None = None) -> dict:
    row = {"cluster": key[0], "endpoint": key[1], "in_flight": load.in_flight, "work": round(load.work, 4),
           "memory_mib": round(load.memory_mib, 1), "tokens": round(load.tokens, 1), "picks": load.picks}
    if total is not None:
        row["share"] = round(load.in_flight / total.in_flight, 4) if total.in_flight > 0 else 0.0
    return row


def _accumulate(sums: dict, loads: Mapping, sign: int, zero) -> None:
    """``sums[key] += loads[key]`` (``sign`` 1) or ``-=`` (-1) for every key; a sum that becomes
    empty is dropped (``zero``: the empty load of that kind)."""
    for key, load in loads.items():
        have = sums.get(key, zero)
        new = have + load if sign > 0 else have - load
        if new.empty:
            sums.pop(key, None)
        else:
            sums[key] = new
