"""Requests in flight per endpoint and per cluster: the picker's own picks minus Envoy's completions.

Envoy ends an ext_proc stream about 1 ms after the request-headers answer (docs/envoy-facts.md, "How long
the ext_proc stream lives"), so stream lifetime says nothing about when a request ends. Envoy's
gRPC access log does: it reports every finished request that carried the picker's cluster header
(:mod:`ext_proc.accesslog` feeds those reports here). In flight = picks - completions, counted
first-in first-out per key, and a pick older than ``expiry_s`` is taken as finished (its record
was lost: the access-log stream broke, Envoy restarted, the buffer overflowed).

Each pick also remembers its request's ``x-request-id``: when Envoy did not apply the picker's
answer (it came after Envoy's ext_proc timeout, and Envoy failed open or answered 500), the
request's log entry carries no cluster header, and its id names the pick to release
(:meth:`InFlight.routed`). Without that, each such pick stayed counted until the expiry (found
by ``inferlb bench soak``: the in-flight count stuck at 1 with nothing in flight).

All methods run on the picker's one event loop: no locks. ``endpoints`` and ``clusters`` are
plain dicts read directly on the request path (the ring reads ``endpoints`` as its loads).
Counts depend only on the picks and completions seen, never on process-local randomness, so two
replicas that saw the same requests hold the same loads and make the same bounded-load choices.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import NamedTuple

from prometheus_client import Counter, Gauge

__all__ = ["FINISHED_KEEP", "InFlight", "MemorySamples", "Pick"]

COMPLETIONS = Counter(
    "inferlb_ext_proc_completions_total",
    "Finished requests reported by Envoy's access log, by whether a pick was waiting for them.",
    ["matched"],
)
EXPIRED = Counter(
    "inferlb_ext_proc_inflight_expired_total",
    "Picks taken as finished because no completion arrived within the expiry (lost records).",
)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
IN_FLIGHT = Gauge("inferlb_ext_proc_in_flight", "Requests in flight (picks - completions), by cluster.", ["cluster"])


#: Endpoints per C-level dict update in :meth:`MemorySamples.of`.
SAMPLES_PIECE = 4096
#: Finished requests kept for the load view's next report at most (older ones are dropped by
#: :meth:`InFlight.expire` when no report took them).
FINISHED_KEEP = 10_000

class MemorySamples(NamedTuple):
    """One round of GPU memory samples, as :meth:`InFlight.set_samples` takes them: ``free``:
    ``{"HOST:PORT": free GPU memory, MiB}``; ``taken_at``: ``{"HOST:PORT": when it was sampled,
    monotonic s}`` (the same endpoints); ``held``: ``{"HOST:PORT": requests the backend held (running
    and waiting) in the same sample}``, for endpoints where that count came with the memory and
    only this picker's requests reach the endpoint (None: no such counts); ``own``: True when
    ``held`` counts this picker's requests alone whatever other pickers send (the control plane
    took theirs out: ``MemorySample.held`` of the shared load view), False when it is the backend's
    whole count (valid only while no other picker decides)."""

    free: dict[str, float]
    taken_at: dict[str, float]
    held: dict[str, float] | None = None
    own: bool = False

    @classmethod
    def of(cls, samples: Mapping[str, tuple[float, float]], held: dict[str, float] | None = None,
           own: bool = False) -> MemorySamples:
        """From ``{"HOST:PORT": (free MiB, taken at, monotonic s)}``, ``held`` and ``own`` as the attributes (pure;
        C-level dict updates of :data:`SAMPLES_PIECE` endpoints each: one update of 60 000 held the
        GIL, which the event loop shares, for tens of ms under load)."""
        free: dict[str, float] = {}
        taken_at: dict[str, float] = {}
        keys, values = list(samples), list(samples.values())
        for start in range(0, len(keys), SAMPLES_PIECE):
            piece, got = keys[start:start + SAMPLES_PIECE], values[start:start + SAMPLES_PIECE]
            free.update(zip(piece, map(_FIRST, got), strict=True))
            taken_at.update(zip(piece, map(_SECOND, got), strict=True))
        return cls(free, taken_at, held, own)


class InFlight:
    """Counts requests in flight from picks and access-log completions, with their work and memory.

    Args:
        expiry_s: a pick with no completion after this many seconds counts as finished (s, > 0).
            Choose it above Envoy's route timeout plus the access-log flush interval.
        clock: monotonic seconds (tests pass a fake one).
        failure_hold_s: an endpoint whose connection failed (:meth:`failed_now`) is not picked for
            this long (s, > 0).
        arrival_slack_s: how long after its pick a request may reach its endpoint (s, >= 0): a
            pick made later than this before a sample's time counts as not yet in the sample.
        completion_lag_s: how long after its endpoint let a request go its completion may reach
            the picker (s, >= 0; Envoy's access-log flush, ``picker.access_log_flush_s``, and the
            trip): a completion the picker learned of less than this after a sample's time counts
            as maybe already free in the sample. Both decide the doubtful requests against
            admission: the estimate errs low, not high, for requests whose delays are within them.
            Measured in the ``edge_cloud`` scenario of ``inferlb bench quality`` (2-core machine,
            bursts at 5x; 2026-12-03, docs/picker.md): pick to arrival p50 1.6, p99 10.3 ms, with
            a tail beyond 50 ms; release to completion p50 5.5, p99 28.5, max 42.8 ms. A 20 ms
            arrival window was tried and left: one round of ``multi_gateway``'s single gateway
            then had OOMs (0.7 %), none before.
        done_keep_s: how long finished requests with memory are remembered for :meth:`set_samples`
            (s, > 0; above the age of the oldest sample used, else the estimate errs low).

    Attributes:
        endpoints: ``{"HOST:PORT": requests in flight}`` for pinned requests (zero entries removed).
        clusters: ``{cluster: requests in flight}`` for every routed request, pinned or not.
        work: ``{"HOST:PORT": predicted work in flight}`` (units of a typical request; the load
            of the bounded-load rule), counted from the picker's own picks from the first request.
        cluster_work: ``{cluster: work in flight}`` of the cluster's pinned requests.
        memory: ``{"HOST:PORT": GPU memory of the pinned requests in flight, MiB}`` (only endpoints
            with some).
        free: ``{"HOST:PORT": estimated free GPU memory, MiB}``: the last reported free memory
            minus the memory of requests picked since that sample and still in flight, plus the
            memory of requests the sample saw running that have finished since (only endpoints
            with a sample; see :meth:`set_samples`).
        failed: ``{"HOST:PORT": until (monotonic s)}``: endpoints not to pick (connect failures,
            resets), cleared by :meth:`expire` once the hold is over.
        streams: access-log streams open now; while none is open, completions cannot arrive,
            so admission control ignores these counts (see :attr:`live`).
        requests: ``{x-request-id: (picked at, cluster, pinned endpoint or None)}`` of the picks
            in flight that carried an id, oldest first.
        changes: picks and completions counted so far (the shared load view reports when it moved).
        finished: ``{"HOST:PORT": ([picked at], [MiB])}`` (two lists, one entry per request) of the
            picks with memory finished or expired since the shared load view's last report took
            them (:func:`ext_proc.load_client.report_message`); :meth:`expire` keeps at most
            :data:`FINISHED_KEEP`, the newest of each endpoint, when no report takes them (no load
            view, or the control plane unreachable).

    Raises:
        ValueError: ``expiry_s``, ``failure_hold_s`` or ``done_keep_s`` is not positive, or
            ``arrival_slack_s`` or ``completion_lag_s`` is negative.
    """

    __slots__ = ("endpoints", "clusters", "work", "cluster_work", "memory", "free", "failed", "streams", "requests",
                 "changes", "_pending_ep", "_pending_cl", "_expiry", "_clock", "_seen", "_completions", "_hold",
                 "_sampled", "_done", "_arrival", "_lag", "_keep", "_doubts", "finished", "_counted", "_young")

    def __init__(self, expiry_s: float = 130.0, clock: Callable[[], float] = time.monotonic,
                 failure_hold_s: float = 5.0, arrival_slack_s: float = 0.05, completion_lag_s: float = 0.05,
                 done_keep_s: float = 10.0) -> None:
        if arrival_slack_s < 0 or completion_lag_s < 0 or done_keep_s <= 0:
            raise ValueError(f"in-flight arrival_slack_s and completion_lag_s must be >= 0 and done_keep_s > 0, "
                             f"got {arrival_slack_s}, {completion_lag_s}, {done_keep_s}")
        if expiry_s <= 0:
            raise ValueError(f"in-flight expiry_s must be > 0, got {expiry_s}")
        if failure_hold_s <= 0:
            raise ValueError(f"in-flight failure_hold_s must be > 0, got {failure_hold_s}")
        self.endpoints: dict[str, int] = {}
        self.clusters: dict[str, int] = {}
        self.work: dict[str, float] = {}
        self.cluster_work: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self.free: dict[str, float] = {}
        self.finished: dict[str, tuple[list[float], list[float]]] = {}
        self.failed: dict[str, float] = {}
        self.streams = 0
        self.requests: dict[bytes, tuple[float, str, str | None]] = {}
        self.changes = 0
        self._pending_ep: dict[str, deque[Pick]] = {}
        self._pending_cl: dict[str, deque[float]] = {}
        self._expiry = expiry_s
        self._hold = failure_hold_s
        self._clock = clock
        self._seen: set[str] = set()
        self._completions = [0, 0]  # unmatched, matched: flushed to the counter by expire()
        self._sampled: dict[str, float] = {}  # endpoint -> time of its memory sample (monotonic s)
        # endpoint -> finished picks with memory, oldest first: (picked at, finished at, MiB)
        self._done: dict[str, deque[tuple[float, float, float]]] = {}
        self._arrival = arrival_slack_s
        self._lag = completion_lag_s
        self._doubts: dict[str, float] = {}  # endpoint -> time of its last uncertain failure
        self._keep = done_keep_s
        self._counted = False  # the last samples gave the backends' counts of held requests
        # endpoint -> [completions learned until (s), picked until (s), MiB not to credit]: picks a sample
        # younger than the completion lag counted as held, some of which may have ended before it
        self._young: dict[str, list[float]] = {}

    @property
    def live(self) -> bool:
        """True while at least one access-log stream is open (completions can arrive)."""
        return self.streams > 0

    @property
    def failure_hold_s(self) -> float:
        """How long an endpoint whose connections fail is not picked (s, > 0; :meth:`failed_now`)."""
        return self._hold

    def picked(self, cluster: str, endpoint: str | None, work: float = 1.0, mib: float = 0.0,
               prompt_tokens: float | None = None, output_tokens: float | None = None, gpu_class: str = "",
               request_id: bytes | None = None, miss: bool = True, uncached: float | None = None) -> None:
        """Count one routed request: to ``cluster``, pinned to ``endpoint`` (None = Envoy chooses),
        with its predicted ``work``, GPU memory need (MiB) and, when known, its tokens (for the
        cost model, with the endpoint's work in flight before this pick and ``miss``: the request
        did not go where its affinity key pointed; ``uncached``: the share of its prompt's blocks the
        prefix index did not say the endpoint held, None when its blocks are unknown), the endpoint's
        GPU class and the request's ``x-request-id`` (an id already in flight is not remembered twice)."""
        now = self._clock()
        self.changes += 1
        if request_id and request_id not in self.requests:
            self.requests[request_id] = (now, cluster, endpoint)
        counts = self.clusters
        counts[cluster] = counts.get(cluster, 0) + 1
        queue = self._pending_cl.get(cluster)
        if queue is None:
            queue = self._pending_cl[cluster] = deque()
        queue.append(now)
        if endpoint is None:
            return
        self.endpoints[endpoint] = self.endpoints.get(endpoint, 0) + 1
        before = self.work.get(endpoint, 0.0)
        self.work[endpoint] = before + work
        self.cluster_work[cluster] = self.cluster_work.get(cluster, 0.0) + work
        if mib:
            self.memory[endpoint] = self.memory.get(endpoint, 0.0) + mib
            if endpoint in self.free:
                self.free[endpoint] -= mib
        picks = self._pending_ep.get(endpoint)
        if picks is None:
            picks = self._pending_ep[endpoint] = deque()
        picks.append((now, work, mib, prompt_tokens, output_tokens, gpu_class, cluster, before, miss, request_id,
                      uncached))

    def completed(self, cluster: str, endpoint: str | None) -> bool:
        """Count one finished request; returns False when no pick was waiting for it (ignored).

        ``endpoint`` is the pin the request carried (None when it was not pinned).
        """
        matched = _remove(self.clusters, self._pending_cl, cluster)
        self.changes += 1
        if endpoint is not None:
            self.finish(endpoint)
        self._completions[matched] += 1
        return matched

    def finish(self, endpoint: str, request_id: bytes | None = None) -> Pick | None:
        """Take the pick of ``endpoint`` with this ``x-request-id`` (else its oldest) off its load and
        return it (None: none waiting). Matching by id gives the cost model each request's own
        features when requests on one endpoint finish out of order."""
        picks = self._pending_ep.get(endpoint)
        if not picks:
            return None
        if request_id:
            for i, candidate in enumerate(picks):  # the endpoint's picks in flight: a handful
                if candidate[9] == request_id:
                    pick = candidate
                    del picks[i]
                    break
            else:
                pick = picks.popleft()
        else:
            pick = picks.popleft()
        self._release(endpoint, pick, len(picks), self._clock())
        if not picks:
            del self._pending_ep[endpoint]
        return pick

    def routed(self, request_id: bytes) -> tuple[str, str | None] | None:
        """The ``(cluster, pinned endpoint)`` the picker chose for the request in flight with this
        ``x-request-id`` (None: none such), forgotten by this call."""
        known = self.requests.pop(request_id, None)
        return None if known is None else known[1:]

    def pop(self, cluster: str, endpoint: str | None, request_id: bytes | None = None) -> Pick | None:
        """As :meth:`completed`, returning the pick the completion matched (None: unpinned or unmatched);
        ``request_id``: the finished request's ``x-request-id``, forgotten."""
        if request_id:
            self.requests.pop(request_id, None)
        matched = _remove(self.clusters, self._pending_cl, cluster)
        self.changes += 1
        self._completions[matched] += 1
        return self.finish(endpoint, request_id) if endpoint is not None else None

    def _release(self, endpoint: str, pick: Pick, left: int, finished_at: float | None = None) -> None:
        """Take ``pick`` off the loads; ``finished_at`` (a completion, not an expiry) remembers it
        for :meth:`set_samples` (an expired pick's end is unknown: it is never credited)."""
        _, work, mib, _, _, _, cluster, _, _, _, _ = pick
        if left:
            self.endpoints[endpoint] = left
            self.work[endpoint] -= work
        else:
            self.endpoints.pop(endpoint, None)
            self.work.pop(endpoint, None)
        cw = self.cluster_work.get(cluster, 0.0) - work
        if cw > 1e-9:
            self.cluster_work[cluster] = cw
        else:
            self.cluster_work.pop(cluster, None)
        if mib:
            finished = self.finished.get(endpoint)
            if finished is None:
                finished = self.finished[endpoint] = ([], [])
            finished[0].append(pick[0])
            finished[1].append(mib)
            held = self.memory.get(endpoint, 0.0) - mib
            if held > 1e-6:
                self.memory[endpoint] = held
            else:
                self.memory.pop(endpoint, None)
        if endpoint in self.free:
            young = self._young.get(endpoint)
            if (young is not None and finished_at is not None and young[2] > 0 and pick[0] <= young[1]
                    and finished_at <= young[0]):
                # Maybe ended before the sample, which then shows its memory free already: withheld.
                withheld = min(mib, young[2])
                young[2] -= withheld
                self.free[endpoint] += mib - withheld
            else:
                self.free[endpoint] += mib
            # Without memory too while the samples give held counts: such a count counts it.
            if finished_at is not None and (mib or self._counted):
                done = self._done.get(endpoint)
                if done is None:
                    done = self._done[endpoint] = deque()
                done.append((pick[0], finished_at, mib))

    def set_samples(self, samples: MemorySamples) -> None:
        """Take fresh memory samples (:class:`MemorySamples`; their dicts are this object's now, and
        ``free`` is changed in place by the picks that follow).

        Each endpoint's estimate restarts from its sample, minus the memory of its picks made after
        the sample was taken and still in flight, plus the memory of the picks the sample saw
        running that have finished since (a sample is 0.5-1 s old when it arrives, longer than most
        requests: without that credit every sample would still count the memory of requests long
        gone). ``arrival_slack_s`` before the sample's time and ``completion_lag_s`` after it decide the
        doubtful ones against admission.
        A sample that arrives less than ``completion_lag_s`` after it was taken (a slow loop that reads
        a scrape at once) may show free the memory of a request that ended just before it while its
        completion is still on its way: the picks at the backend by the sample's time and not
        reported finished count as held in it, and the completions of those that arrive within
        ``completion_lag_s`` after the sample's time are not credited (the memory of the largest
        ones that may have ended is withheld). Crediting them made the estimate one request above
        the GPU's free memory until the next sample (the lab's ``uneven`` scenario: 0.5 % OOM).
        Where ``samples.held`` gives the backend's count of requests it held in the sample, that count
        settles the doubtful ones: the requests certainly in the sample are counted, and as many of
        the doubtful ones as the count leaves over once every maybe-ended pick is taken as held
        count as in it, the smallest first; as many maybe-ended picks as the count leaves over once
        every doubtful one is taken as held are credited when they end (the estimate errs low, never
        high, when the count holds only this picker's requests). With one memory size and a sample
        older than ``completion_lag_s``, the estimate is then exact:
        free = sample + size x (held - in flight now).
        Endpoints absent from ``samples`` lose their estimate (unknown: admitted).
        O(requests in flight + finished in ``done_keep_s``): the two 60 000-entry dicts are built by
        :meth:`MemorySamples.of` wherever the caller likes (off the event loop: 25-30 ms at 60 000
        endpoints, measured on the shared 2-core machine); call once per metrics round.
        """
        free, sampled, counts, _ = samples
        self._counted = counts is not None
        arrival, lag = self._arrival, self._lag
        now = self._clock()
        young: dict[str, list[float]] = {}
        for endpoint in self._pending_ep.keys() | self._done.keys():  # only endpoints with recent picks
            taken = sampled.get(endpoint)
            if taken is None:
                continue
            before, after = taken - arrival, taken + lag
            estimate = free[endpoint]
            held = None if counts is None else counts.get(endpoint)
            certain, doubtful, maybe_gone = 0, [], []
            for pick in self._pending_ep.get(endpoint, ()):
                if pick[0] > before:  # picked after the sample (or maybe): not in it yet
                    estimate -= pick[2]
                    if pick[0] <= taken:
                        doubtful.append(pick[2])
                elif now < after:  # at the backend, but may have ended before a sample this young
                    maybe_gone.append(pick[2])
                else:
                    certain += 1
            for picked_at, finished_at, used in self._done.get(endpoint, ()):
                if picked_at <= before and finished_at > after:  # running in the sample, gone now
                    estimate += used
                    certain += 1
                elif picked_at <= taken < finished_at:  # maybe running in the sample (not credited)
                    doubtful.append(used)
            # Of the doubtful and the maybe gone, the count's held requests not certain: at least
            # room - len(maybe_gone) doubtful ones and room - len(doubtful) maybe gone ones were held.
            room = None if held is None else int(held) - certain
            if room is not None and doubtful:
                n = min(len(doubtful), room - len(maybe_gone))
                if n > 0:
                    estimate += sum(sorted(doubtful)[:n])
            if maybe_gone:
                kept = 0 if room is None else max(0, min(len(maybe_gone), room - len(doubtful)))
                if kept < len(maybe_gone):  # the others may have ended: withhold the largest ones' memory
                    young[endpoint] = [after, before, sum(sorted(maybe_gone)[kept:])]
            free[endpoint] = estimate
        self.free = free
        self._sampled = sampled
        self._young = young

    def by_endpoint(self, since: float) -> dict[tuple[str, str], tuple[int, float, float, float, int]]:
        """The pinned load in flight per ``(cluster, endpoint)``: ``(requests, work, MiB, tokens, picks
        at or after since)`` (tokens: prompt + output where known; ``since``: monotonic s, as the
        clock: the previous report's time, and a pick at the same reading may have come after that
        report was built; the control plane's count of the requests a memory sample may hold,
        :func:`xds_server.loadview.rounds.maybe_held`, must not miss it).

        O(requests in flight); for the load report (:mod:`ext_proc.shared_load`), not the request path.
        """
        out: dict[tuple[str, str], list] = {}
        for endpoint, picks in self._pending_ep.items():
            for at, work, mib, prompt, output, _, cluster, _, _, _, _ in picks:
                row = out.get((cluster, endpoint))
                if row is None:
                    row = out[(cluster, endpoint)] = [0, 0.0, 0.0, 0.0, 0]
                row[0] += 1
                row[1] += work
                row[2] += mib
                row[3] += (prompt or 0.0) + (output or 0.0)
                if at >= since:
                    row[4] += 1
        return {key: (n, w, m, t, p) for key, (n, w, m, t, p) in out.items()}

    def now(self) -> float:
        """The in-flight clock's time (monotonic s)."""
        return self._clock()

    def failed_now(self, endpoint: str, certain: bool = True) -> bool:
        """Count one failure of ``endpoint``; returns True when that newly marks it failing (then it
        is skipped for ``failure_hold_s``).

        ``certain``: Envoy flagged a connect failure, reset or termination: marked at once. Not
        certain: Envoy retried the request on another host, which a 5xx answer (an out-of-memory
        500) causes as well as a broken connection; one such retry is a moment, not a failing
        endpoint, so it is marked at the second within ``failure_hold_s``.
        """
        now = self._clock()
        fresh = endpoint not in self.failed
        if not certain and fresh:
            last = self._doubts.get(endpoint)
            self._doubts[endpoint] = now
            if last is None or now - last > self._hold:
                return False
        self._doubts.pop(endpoint, None)
        self.failed[endpoint] = now + self._hold
        return fresh

    def expire(self) -> int:
        """Drop picks older than the expiry, end failure holds, and publish the counters (call every
        second or so).

        Returns how many picks expired. (Completions are counted in plain ints on the request
        path and added to ``inferlb_ext_proc_completions_total`` here: no lock per request.)
        """
        now = self._clock()
        limit = now - self._expiry
        expired = _expire(self.clusters, self._pending_cl, limit)
        if self.requests:
            old = []
            for rid, (at, _, _) in self.requests.items():  # oldest first: stop at the first young one
                if at >= limit:
                    break
                old.append(rid)
            for rid in old:
                del self.requests[rid]
        for endpoint in list(self._pending_ep):
            picks = self._pending_ep[endpoint]
            while picks and picks[0][0] < limit:
                pick = picks.popleft()
                self._release(endpoint, pick, len(picks))
            if not picks:
                del self._pending_ep[endpoint]
        keep = now - self._keep
        for endpoint in list(self._done):
            done = self._done[endpoint]
            while done and done[0][1] < keep:
                done.popleft()
            if not done:
                del self._done[endpoint]
        kept = sum(len(picked) for picked, _ in self.finished.values())
        if kept > FINISHED_KEEP:  # each endpoint's newest, in proportion (its lists are in finishing order)
            for picked, mibs in self.finished.values():
                drop = len(picked) - len(picked) * FINISHED_KEEP // kept
                del picked[:drop], mibs[:drop]
        if self.failed:
            for endpoint in [e for e, until in self.failed.items() if until <= now]:
                del self.failed[endpoint]
        if self._doubts:
            for endpoint in [e for e, at in self._doubts.items() if at + self._hold <= now]:
                del self._doubts[endpoint]
        if expired:
            EXPIRED.inc(expired)
        unmatched, matched = self._completions
        self._completions = [0, 0]
        COMPLETIONS.labels("no").inc(unmatched)
        COMPLETIONS.labels("yes").inc(matched)
        self._seen.update(self.clusters)
        for cluster in self._seen:
            IN_FLIGHT.labels(cluster).set(self.clusters.get(cluster, 0))
        return expired


#: One pick in flight: ``(time, work, mib, prompt_tokens, output_tokens, gpu_class, cluster, load
#: before, miss, x-request-id or None)``: ``load before`` is the endpoint's work in flight when it
#: was picked.
Pick = tuple[float, float, float, "float | None", "float | None", str, str, float, bool, "bytes | None",
             "float | None"]


def _remove(counts: dict[str, int], pending: dict[str, deque[float]], key: str) -> bool:
    queue = pending.get(key)
    if not queue:
        return False
    queue.popleft()
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]
        del pending[key]
    return True


def _expire(counts: dict[str, int], pending: dict[str, deque[float]], limit: float) -> int:
    expired = 0
    for key in list(pending):
        queue = pending[key]
        while queue and queue[0] < limit:
            queue.popleft()
            expired += 1
        if queue:
            counts[key] = len(queue)
        else:
            del pending[key]
            counts.pop(key, None)
    return expired
