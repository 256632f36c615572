"""Requests in flight per endpoint and per cluster: the picker's own picks minus Envoy's completions.

Envoy ends an ext_proc stream about 1 ms after the request-headers answer (docs/envoy-facts.md, "How long
the ext_proc stream lives"), so stream lifetime says nothing about when a request ends. Envoy's
gRPC access log does: it reports every finished request that carried the picker's cluster header
(:mod:`ext_proc.accesslog` feeds those reports here). In flight = picks - completions, counted
first-in first-out per key, and a pick older than ``expiry_s`` is taken as finished (its record
was lost: the access-log stream broke, Envoy restarted, the buffer overflowed).

All methods run on the picker's one event loop: no locks. ``endpoints`` and ``clusters`` are
plain dicts read directly on the request path (the ring reads ``endpoints`` as its loads).
Counts depend only on the picks and completions seen, never on process-local randomness, so two
replicas that saw the same requests hold the same loads and make the same bounded-load choices.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter, Gauge

__all__ = ["InFlight"]

COMPLETIONS = Counter(
    "inferlb_ext_proc_completions_total",
    "Finished requests reported by Envoy's access log, by whether a pick was waiting for them.",
    ["matched"],
)
EXPIRED = Counter(
    "inferlb_ext_proc_inflight_expired_total",
    "Picks taken as finished because no completion arrived within the expiry (lost records).",
)
IN_FLIGHT = Gauge("inferlb_ext_proc_in_flight", "Requests in flight (picks - completions), by cluster.", ["cluster"])


class InFlight:
    """Counts requests in flight from picks and access-log completions.

    Args:
        expiry_s: a pick with no completion after this many seconds counts as finished (s, > 0).
            Choose it above Envoy's route timeout plus the access-log flush interval.
        clock: monotonic seconds (tests pass a fake one).

    Attributes:
        endpoints: ``{"HOST:PORT": requests in flight}`` for pinned requests (zero entries removed).
        clusters: ``{cluster: requests in flight}`` for every routed request, pinned or not.
        streams: access-log streams open now; while none is open, completions cannot arrive,
            so admission control ignores these counts (see :attr:`live`).

    Raises:
        ValueError: ``expiry_s`` is not positive.
    """

    __slots__ = ("endpoints", "clusters", "streams", "_pending_ep", "_pending_cl", "_expiry", "_clock", "_seen",
                 "_completions")

    def __init__(self, expiry_s: float = 130.0, clock: Callable[[], float] = time.monotonic) -> None:
        if expiry_s <= 0:
            raise ValueError(f"in-flight expiry_s must be > 0, got {expiry_s}")
        self.endpoints: dict[str, int] = {}
        self.clusters: dict[str, int] = {}
        self.streams = 0
        self._pending_ep: dict[str, deque[float]] = {}
        self._pending_cl: dict[str, deque[float]] = {}
        self._expiry = expiry_s
        self._clock = clock
        self._seen: set[str] = set()
        self._completions = [0, 0]  # unmatched, matched: flushed to the counter by expire()

    @property
    def live(self) -> bool:
        """True while at least one access-log stream is open (completions can arrive)."""
        return self.streams > 0

    def picked(self, cluster: str, endpoint: str | None) -> None:
        """Count one routed request: to ``cluster``, pinned to ``endpoint`` (None = Envoy chooses)."""
        now = self._clock()
        _add(self.clusters, self._pending_cl, cluster, now)
        if endpoint is not None:
            _add(self.endpoints, self._pending_ep, endpoint, now)

    def completed(self, cluster: str, endpoint: str | None) -> bool:
        """Count one finished request; returns False when no pick was waiting for it (ignored).

        ``endpoint`` is the pin the request carried (None when it was not pinned).
        """
        matched = _remove(self.clusters, self._pending_cl, cluster)
        if endpoint is not None:
            _remove(self.endpoints, self._pending_ep, endpoint)
        self._completions[matched] += 1
        return matched

    def expire(self) -> int:
        """Drop picks older than the expiry and publish the counters (call every second or so).

        Returns how many picks expired. (Completions are counted in plain ints on the request
        path and added to ``inferlb_ext_proc_completions_total`` here: no lock per request.)
        """
        limit = self._clock() - self._expiry
        expired = _expire(self.clusters, self._pending_cl, limit)
        _expire(self.endpoints, self._pending_ep, limit)
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


def _add(counts: dict[str, int], pending: dict[str, deque[float]], key: str, now: float) -> None:
    counts[key] = counts.get(key, 0) + 1
    queue = pending.get(key)
    if queue is None:
        queue = pending[key] = deque()
    queue.append(now)


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
