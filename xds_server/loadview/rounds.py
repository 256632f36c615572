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
credit them a second time). Where the slow loop reads the backends' counts of held requests with
their memory (``picker.memory_count_in_sample``), the count settles the others' requests those two
windows leave in doubt, as a lone picker settles its own (:func:`settled`): each picker's baseline
also counts the others' doubtful requests the count says were held, at least.

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
           "held", "maybe_held", "settled"]

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
    settled: Mapping[str, Mapping[str, float]] = field(default_factory=lambda: _NONE)
    """``{picker: {"HOST:PORT": MiB}}``: the other pickers' doubtful requests the backend's count says
    the sample held, at least, beyond their share (:func:`settled`; > 0 only, only with :attr:`held`)."""

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
        more = self.settled.get(picker) if picker is not None else None
        if not own and not more:
            return self.total
        out = dict(self.total)
        for endpoint, mib in (own or {}).items():
            out[endpoint] = max(0.0, out[endpoint] - mib)
        for endpoint, mib in (more or {}).items():
            out[endpoint] = out.get(endpoint, 0.0) + mib
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


def settled(histories: Mapping[str, History], samples: Mapping[str, tuple[float, float]],
            held_counts: Mapping[str, float], maybe: Mapping[str, Mapping[str, float]],
            slack_s: float = PICK_SLACK_S, lag_s: float = FINISH_LAG_S) -> dict[str, dict[str, float]]:
    """``{picker: {"HOST:PORT": MiB}}`` (> 0 only): of the *other* pickers' doubtful requests, the memory
    the backend's count of held requests says each sample held, at least, beyond what :func:`held`
    counts of theirs (the baseline's certain part).

    :func:`held` leaves out, against admission, a request picked less than ``slack_s`` before the
    sample and one reported finished up to ``lag_s`` after it: either may or may not be in it. A lone
    picker settles its own doubtful requests with the backend's count (:meth:`ext_proc.inflight.InFlight.set_samples`);
    the others' stayed unsettled, so each one the sample did hold was never credited when it ended
    and the estimate stayed its memory low for the whole round (the lab's ``multi_gateway``: 26 of 37
    429s, 18 GiB requests refused beside an empty GPU). With ``H`` the backend's count, ``U_p`` the
    picker's requests the sample may hold (``maybe``, :func:`maybe_held`: never below the truth) and
    ``c_q`` each other picker's certain ones (those :func:`held` counts), at least ``H - U_p - sum c_q``
    of the others' doubtful requests were held: that many count, the smallest first. Their sizes: a
    request reported finished carries its own; a pick still in flight at its first report, that
    report's memory in flight less the report before's plus what it reported finished of the report
    before's requests, when it was the report's one pick there;
    0 when the report had several (it gives only their sum). Every doubtful request has a size at most
    its own in the list (some twice: harmless, the sum of the smallest can only fall), so the sum errs
    low, never high. A picker's own share of the count (:meth:`RoundCounts.own_held`) is bounded the
    same way from the other side; the two bounds hold at once, each in every case the count allows.

    Per picker: each sample's base report by one vectorised search (as :func:`held`), one pass over
    the finished requests of the reports after the oldest base, and only for the samples where the
    count leaves some request to settle, the reports from its base to the first after it.
    O(samples x pickers + finished of those reports + (samples to settle) x pickers x (log(reports) +
    reports in the slack) + doubtful requests x log).
    """
    names = [e for e in samples if e in held_counts]
    if not names or len(histories) < 2:
        return {}
    position = {e: i for i, e in enumerate(names)}
    taken = np.fromiter((samples[e][1] for e in names), float, len(names))
    certain: dict[str, list[float]] = {}
    sizes: dict[str, dict[str, list[float]]] = {}  # picker -> endpoint -> a size at most per doubtful request
    kept: dict[str, tuple] = {}  # picker -> what the picks' pass reads: (received, bases, freed, ends_n)
    for picker, reports in histories.items():
        received = [r[0] for r in reports]
        times = np.fromiter(received, float, len(received))
        bases = np.maximum(np.searchsorted(times, taken - slack_s, side="right") - 1, 0).tolist()
        ends = np.searchsorted(times, taken + lag_s, side="right").tolist()
        counts = [reports[b][3].get(e, _NO_COUNT)[0] for e, b in zip(names, bases, strict=True)]
        mine: dict[str, list[float]] = {}
        freed: dict[int, dict[str, float]] = {}  # report -> {endpoint: MiB finished of the report before's}
        ends_n: dict[int, dict[str, int]] = {}  # report -> {endpoint: requests it reported finished}
        for k in range(min(bases) + 1, len(reports)):
            ended, ended_n = freed[k], ends_n[k] = {}, {}
            for endpoint, picked_at, mib in reports[k][2]:
                ended_n[endpoint] = ended_n.get(endpoint, 0) + 1
                if picked_at < received[k - 1] - _TIE_S:
                    ended[endpoint] = ended.get(endpoint, 0.0) + mib
                i = position.get(endpoint)
                if i is None or k <= bases[i]:
                    continue
                base_at, at = received[bases[i]], samples[endpoint][1]
                # In the base report's count: held() also takes a pick at its very time as in it, which errs
                # its MiB low; here that would err the certain count low and the forced count high.
                if picked_at < base_at - _TIE_S and base_at < received[k]:
                    if k < ends[i]:
                        counts[i] -= 1   # reported finished by the lag: not certain
                        if received[k] > at:   # ... and after the sample: maybe held
                            mine.setdefault(endpoint, []).append(mib)
                elif picked_at <= at < received[k]:   # picked after the base, reported finished after the sample
                    mine.setdefault(endpoint, []).append(mib)
        certain[picker], sizes[picker], kept[picker] = counts, mine, (received, bases, freed, ends_n)
    total = [sum(c) for c in zip(*certain.values(), strict=True)]
    forced: dict[str, dict[int, int]] = {}  # picker -> {endpoint index: the others' doubtful requests held}
    for picker in histories:
        share, own = maybe.get(picker, _NONE), certain[picker]
        forced[picker] = {i: n for i, e in enumerate(names)
                          if (n := int(held_counts[e] - share.get(e, 0.0) - (total[i] - own[i]))) > 0}
    wanted = sorted({i for f in forced.values() for i in f})
    for picker, reports in histories.items():
        received, bases, freed, ends_n = kept[picker]
        mine = sizes[picker]
        for i in wanted:
            e = names[i]
            # The picks after the base report and by the sample's time still in flight at their first
            # report, report by report (as many as its picks since the report before, at most its rise
            # in requests in flight plus those it reported finished): one pick alone is known by its
            # size (the report's memory in flight less the one before's, plus what it reported finished
            # of that one's); of several, each counts 0 (the reports give only their sum).
            last = min(bisect_right(received, samples[e][1] + _TIE_S), len(reports) - 1)
            for k in range(bases[i] + 1, last + 1):
                count, picks = reports[k][3].get(e, _NO_COUNT)
                # At most this many are new: a pick at the report before's very time is counted by both.
                picks = min(int(picks), int(count - reports[k - 1][3].get(e, _NO_COUNT)[0] + ends_n[k].get(e, 0)))
                if picks == 1:
                    mib = reports[k][1].get(e, 0.0) - reports[k - 1][1].get(e, 0.0) + freed[k].get(e, 0.0)
                    mine.setdefault(e, []).append(max(0.0, mib))
                elif picks > 1:
                    mine.setdefault(e, []).extend([0.0] * picks)
    out: dict[str, dict[str, float]] = {}
    for picker in histories:
        others = [sizes[q] for q in histories if q != picker]
        extra: dict[str, float] = {}
        for i, n in forced[picker].items():
            e = names[i]
            mib = sum(sorted(m for doubts in others for m in doubts.get(e, ()))[:n])
            if mib > 0:
                extra[e] = mib
        out[picker] = extra
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
    maybe = maybe_held(histories, samples)
    return RoundCounts(round_, samples, MappingProxyType(capacities), shares, _sum(shares.values()),
                       MappingProxyType(dict(held_counts)), maybe, settled(histories, samples, held_counts, maybe))


def _sum(shares) -> dict[str, float]:
    """``{"HOST:PORT": MiB}`` summed over ``shares`` (dicts of the same shape)."""
    out: dict[str, float] = {}
    for share in shares:
        for endpoint, mib in share.items():
            out[endpoint] = out.get(endpoint, 0.0) + mib
    return out
