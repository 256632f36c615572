"""A memory round's counts: what each picker's requests each GPU memory sample holds, and each
endpoint's learned capacity (pure: a snapshot of the load table's reports in, the counts out).

Every picker's free-memory estimate starts from the slow loop's sample of an endpoint, which already
holds the requests of every picker running there when it was taken. Each picker adds what it sends
after the sample; what the *others* sent is added from the shared view, less what the sample holds
of theirs: the baseline (:attr:`RoundCounts.shares`). The control plane knows it from each picker's
reports, kept :data:`HISTORY_S`: per picker and endpoint, the memory in flight in the last report
received by the sample's time less :data:`PICK_SLACK_S` (a pick reported later may not have reached
the endpoint), less the requests of that report it reported finished there by the sample's time plus
:data:`FINISH_LAG_S` (free in the sample although reported after it; without this the picker would
credit them a second time).

A round is counted once, in a worker thread (:meth:`LoadTable.round_counter`): at 60 000 endpoints
with memory traffic the count costs hundreds of ms of CPU, which the event loop the ADS server shares
must not wait for. Counted per endpoint and per view on the loop, one round blocked the loop 9.4 s
with 3 pickers and 1 s of their reports (BENCHMARKS.md, "Load view"; ``bench.loadview_round``).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from types import MappingProxyType

import numpy as np

__all__ = ["CAPACITY_ROUNDS", "FINISH_LAG_S", "HISTORY_S", "PICK_SLACK_S", "History", "RoundCounts", "count_round",
           "held", "maybe_held"]

#: How far back each picker's reported memory is kept (s): longer than any memory sample's age.
HISTORY_S = 10.0
#: A request another picker reported in flight this long before a memory sample was taken had
#: reached its endpoint by then (s): Envoy forwards a pick in milliseconds.
PICK_SLACK_S = 0.05
#: A request that finished before a memory sample was taken has been reported finished by this
#: long after it (s): Envoy's access-log flush (5 ms), the picker's report interval (10 ms) and
#: the stream, with room for a loaded machine.
FINISH_LAG_S = 0.1
#: Memory rounds an endpoint's capacity is learned over (:func:`count_round`).
CAPACITY_ROUNDS = 9

#: One picker's kept reports, oldest first: ``(received at (monotonic s), {"HOST:PORT": MiB in flight},
#: [("HOST:PORT", picked at (monotonic s), MiB) finished since the report before], {"HOST:PORT":
#: (requests in flight, picks since the report before)})`` (the fourth, read only by
#: :func:`maybe_held`, may be left out where no held counts come with the samples).
History = Sequence[tuple]

_NONE: Mapping = MappingProxyType({})
_NO_COUNT = (0.0, 0.0)
#: Pick times are told as ages and read back as ``received - age``: this much rounding counts as a tie (s).
_TIE_S = 1e-6
#: Endpoints per C-level step of :func:`held` (one step holds the GIL the event loop needs).
_PIECE = 4096


@dataclass(frozen=True, slots=True)
class RoundCounts:
    """One memory round, counted: ``round`` (:attr:`LoadTable.memory_round`; 0: none), its
    ``samples`` (``{"HOST:PORT": (free MiB, taken at, monotonic s)}``), the ``capacities`` learned
    (``{"HOST:PORT": MiB the endpoint's requests can use}``, only endpoints with memory reported in
    the last :data:`HISTORY_S`), each picker's ``shares`` of the samples (``{picker: {"HOST:PORT":
    MiB}}``, > 0 only) and their ``total`` per endpoint."""

    round: int = 0
    samples: Mapping[str, tuple[float, float]] = field(default_factory=lambda: _NONE)
    capacities: Mapping[str, float] = field(default_factory=lambda: _NONE)
    shares: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: _NONE)
    total: Mapping[str, float] = field(default_factory=lambda: _NONE)
    held: Mapping[str, float] | None = None
    """``{"HOST:PORT": requests the backend held in the sample}`` (the slow loop's count from the
    same scrape as the free memory; None: no such counts)."""
    maybe: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: _NONE)
    """``{picker: {"HOST:PORT": requests of the picker the sample may hold, at most}}``
    (:func:`maybe_held`; > 0 only, counted only with :attr:`held`)."""

    def own_held(self, picker: str | None) -> dict[str, float]:
        """``{"HOST:PORT": requests of ``picker`` the sample held, at least}``: the backend's count less
        every other picker's requests the sample may hold (never below 0; empty without :attr:`held`).
        The picker settles its doubtful requests with it as with a count of its own alone: an
        over-count of the others errs its estimate low, never high. O(endpoints x pickers)."""
        if self.held is None:
            return {}
        others: dict[str, float] = {}
        for name, share in self.maybe.items():
            if name != picker:
                for endpoint, n in share.items():
                    others[endpoint] = others.get(endpoint, 0.0) + n
        return {e: max(0.0, n - others.get(e, 0.0)) for e, n in self.held.items()}

    def others(self, picker: str | None) -> Mapping[str, float]:
        """``{"HOST:PORT": MiB}`` of the pickers other than ``picker`` (None: every picker) that
        each sample holds (endpoints left out: 0): the total less ``picker``'s share, O(its share)."""
        own = self.shares.get(picker) if picker is not None else None
        if not own:
            return self.total
        out = dict(self.total)
        for endpoint, mib in own.items():
            out[endpoint] = max(0.0, out[endpoint] - mib)
        return out


def held(histories: Mapping[str, History], samples: Mapping[str, tuple[float, float]],
         slack_s: float, lag_s: float = FINISH_LAG_S) -> dict[str, dict[str, float]]:
    """``{picker: {"HOST:PORT": MiB of its requests the sample holds}}`` (> 0 only) of each sample in
    ``samples`` (``{"HOST:PORT": (free MiB, taken at, monotonic s)}``), by the module's rule with
    ``slack_s`` (s) in place of :data:`PICK_SLACK_S` and ``lag_s`` (s) in place of :data:`FINISH_LAG_S`;
    a picker with no report by then: its oldest.

    Per picker: each sample's base report found by one vectorised search over the reports' receive
    times, the base values read with one C-level ``map`` per base report, then one pass over the
    finished requests of the reports that can count. O(samples x pickers x log(reports) + finished).
    """
    names = list(samples)
    if not names:
        return {picker: {} for picker in histories}
    keys = np.array(names, dtype=object)
    taken = np.fromiter((at for _, at in samples.values()), float, len(names))
    before, after = taken - slack_s, taken + lag_s
    position: dict[str, int] | None = None
    out: dict[str, dict[str, float]] = {}
    for picker, reports in histories.items():
        received = np.fromiter((r[0] for r in reports), float, len(reports))
        base = np.maximum(np.searchsorted(received, before, side="right") - 1, 0)
        end = np.searchsorted(received, after, side="right")
        mine = np.zeros(len(names))
        order = np.argsort(base, kind="stable")
        for group in np.split(order, np.flatnonzero(np.diff(base[order])) + 1):
            in_flight = reports[base[group[0]]][1]
            mine[group] = np.fromiter(map(in_flight.get, keys[group], repeat(0.0)), float, len(group))
        first, last = int(base.min()) + 1, int(end.max())
        if any(reports[k][2] for k in range(first, last)):
            if position is None:
                position = {e: i for i, e in enumerate(names)}
            bases, ends, times = base.tolist(), end.tolist(), received.tolist()
            for k in range(first, last):
                for endpoint, picked_at, mib in reports[k][2]:
                    i = position.get(endpoint)
                    if i is None:
                        continue
                    b = bases[i]
                    # Reported finished after the base report and by the lag, and counted in the base.
                    if b < k < ends[i] and picked_at <= times[b] < times[k]:
                        mine[i] -= mib
        some = np.flatnonzero(mine > 0.0)
        share: dict[str, float] = {}
        for start in range(0, len(some), _PIECE):  # C-level pieces: the event loop's thread gets the GIL between
            piece = some[start:start + _PIECE]
            share.update(zip(keys[piece].tolist(), mine[piece].tolist(), strict=True))
        out[picker] = share
    return out


def maybe_held(histories: Mapping[str, History],
               samples: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """``{picker: {"HOST:PORT": requests of the picker the sample may hold, at most}}`` (> 0 only) of
    each sample in ``samples`` (``{"HOST:PORT": (free MiB, taken at, monotonic s)}``), from the
    histories' fourth elements (:data:`History`).

    A request held at the sample's time was picked before it and had not ended. Per picker, with
    ``b`` its last report received by the sample's time and ``b + 1`` the next (if in yet): the
    requests in flight in ``b`` (some may have ended since: counted), plus the picks in flight in
    ``b + 1`` (picked after ``b``, some after the sample: counted), plus the requests ``b + 1``
    reported finished that were picked after ``b`` and by the sample's time (never in a report's
    in-flight count); a pick at the very time of ``b`` counts as after it (it may be: counted twice
    at worst). A request picked by the sample's time is in one of them when its picker reports it
    by :data:`FINISH_LAG_S` after the sample (as :func:`held` assumes), so the sum is never below
    the truth (an over-count errs the picker's estimate low; while a report's picks left out a pick
    at the same clock reading as the report before, 25 of 1 488 picker-endpoint rounds of the lab's
    ``multi_gateway``, 150 s, came out one request under, each putting an estimate one request high).
    O(samples x pickers + the finished of the reports read).
    """
    out: dict[str, dict[str, float]] = {}
    for picker, reports in histories.items():
        received = [r[0] for r in reports]
        finished: dict[int, dict[str, list[float]]] = {}  # report index -> {endpoint: [picked at]}
        share: dict[str, float] = {}
        for endpoint, (_, taken) in samples.items():
            b = bisect_right(received, taken) - 1
            n = reports[b][3].get(endpoint, _NO_COUNT)[0] if b >= 0 else 0.0
            if b + 1 < len(reports):
                after = reports[b + 1]
                n += after[3].get(endpoint, _NO_COUNT)[1]
                ended = finished.get(b + 1)
                if ended is None:
                    ended = finished[b + 1] = {}
                    for e, picked_at, _ in after[2]:
                        ended.setdefault(e, []).append(picked_at)
                since = received[b] - _TIE_S if b >= 0 else -math.inf
                n += sum(1 for picked_at in ended.get(endpoint, ()) if since <= picked_at <= taken + _TIE_S)
            if n > 0:
                share[endpoint] = n
        out[picker] = share
    return out


def count_round(round_: int, samples: Mapping[str, tuple[float, float]], histories: Mapping[str, History],
                active: set[str] | frozenset[str], implied: dict[str, deque[float]],
                held_counts: Mapping[str, float] | None = None) -> RoundCounts:
    """Count memory round ``round_`` (``samples`` as :class:`RoundCounts`) over ``histories``
    (``{picker: History}``), for the ``active`` endpoints (memory reported in the last
    :data:`HISTORY_S`; the others' requests are unknown).

    Capacities: each round's sample implies ``free + the memory of every picker's requests the sample
    holds`` (counted with the picks reported by the sample's time, not :data:`PICK_SLACK_S` before
    it: on a busy endpoint one lands in most samples' last 50 ms, on the GPU already, and the
    capacity came out one request short; and less only the requests reported finished by the
    sample's time, not :data:`FINISH_LAG_S` after it: one reported in those 100 ms mostly ran in
    the sample, and rounds one request short came so often that the median was too: in the lab's
    ``multi_gateway``, capacities of 6 and 16 GiB where requests can use 24, refusing 18 GiB
    requests an empty GPU could take); the capacity is the median of the last
    :data:`CAPACITY_ROUNDS` of them (``implied``: ``{"HOST:PORT": implied capacities, MiB}``, kept
    by the caller between rounds and updated here), so one round's wrong count (a request counted in
    flight that had ended, or one not reported yet) does not move it.

    A picker's free-memory estimate adds to its sample what it learns of requests finished since; a
    completion counted twice (free in the sample, and again as finished) leaves the estimate above
    what the GPU has: 32 and 40 GiB free where the requests can use 24 GiB (``multi_gateway`` of
    ``inferlb bench quality``). The picker caps the estimate at the capacity less the memory every
    picker has in flight there (:class:`ext_proc.shared_load.SharedLoad`).
    """
    counted = {e: samples[e] for e in active if e in samples}
    # Forgotten only without memory reported: a round without its sample (metrics missing) keeps the rounds before.
    for endpoint in [e for e in implied if e not in active]:
        del implied[endpoint]
    on_gpu = _sum(held(histories, counted, slack_s=0.0, lag_s=0.0).values())
    capacities: dict[str, float] = {}
    for endpoint, (free, _) in counted.items():
        rounds = implied.get(endpoint)
        if rounds is None:
            rounds = implied[endpoint] = deque(maxlen=CAPACITY_ROUNDS)
        rounds.append(free + on_gpu.get(endpoint, 0.0))
        capacities[endpoint] = sorted(rounds)[len(rounds) // 2]
    shares = held(histories, counted, slack_s=PICK_SLACK_S)
    if held_counts is None:
        return RoundCounts(round_, samples, MappingProxyType(capacities), shares, _sum(shares.values()))
    return RoundCounts(round_, samples, MappingProxyType(capacities), shares, _sum(shares.values()),
                       MappingProxyType(dict(held_counts)), maybe_held(histories, samples))


def _sum(shares) -> dict[str, float]:
    """``{"HOST:PORT": MiB}`` summed over ``shares`` (dicts of the same shape)."""
    out: dict[str, float] = {}
    for share in shares:
        for endpoint, mib in share.items():
            out[endpoint] = out.get(endpoint, 0.0) + mib
    return out
