"""Admission control: when a cluster is at its max concurrency, queue in the picker or answer 429.

A cluster is full when the requests in flight the picker routed to it (picks minus access-log
completions, :mod:`ext_proc.inflight`) reach the sum of its pinnable endpoints' max concurrency
(from EDS endpoint metadata ``inferlb.max_concurrency``). A request for a full cluster, or one no
endpoint has the GPU memory for, waits in that cluster's queue — at most ``max_queue`` waiting,
each at most ``timeout_s`` — and is decided when a slot is free and an endpoint has the memory for
it (oldest first, with backfill: see :meth:`Admission.release`); otherwise it gets 429 with
``Retry-After``. The wait must end before Envoy's ext_proc ``message_timeout``, or Envoy gives up
on the picker first.

:func:`admit` is the pure rule; :class:`Admission` keeps the queues (event loop only, no locks).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Literal

from prometheus_client import Counter, Gauge

__all__ = ["Admission", "admit", "settle"]

ADMISSION = Counter(
    "inferlb_ext_proc_admission_total",
    "Requests for a full cluster, by outcome: queued, admitted (after queueing), "
    "rejected_full (queue full), rejected_timeout (waited too long), cancelled (stream ended).",
    ["cluster", "outcome"],
)
#: How deep :meth:`Admission.release` looks past waiters that do not fit yet for one that does (a
#: bound on the pick it costs per waiter at each completion; EASY-style backfilling, Lifka 1995).
BACKFILL = 32

QUEUED = Gauge("inferlb_ext_proc_queued", "Requests waiting in the picker for a free slot, by cluster.", ["cluster"])


def admit(in_flight: int, capacity: int, queued: int, max_queue: int) -> Literal["admit", "queue", "reject"]:
    """The admission rule for one request of a cluster.

    Args:
        in_flight: requests in flight in the cluster.
        capacity: the cluster's max concurrency (sum over its pinnable endpoints); 0 = unknown,
            never limited.
        queued: requests already waiting for the cluster.
        max_queue: how many may wait (0 = reject at once when full).

    Returns:
        "admit" when there is room (and nobody waits ahead: FIFO), "queue" when full and the
        queue has room, else "reject".
    """
    if capacity <= 0 or (in_flight < capacity and queued == 0):
        return "admit"
    return "queue" if queued < max_queue else "reject"


def settle(future: asyncio.Future[bytes], answer: Callable[[], bytes | asyncio.Future[bytes]]) -> None:
    """Resolve ``future`` with ``answer()``: its bytes, or what the future it returns resolves to (a
    cancelled ``future`` cancels that one); an exception goes to ``future`` (the transport answers
    INTERNAL)."""
    try:
        result = answer()
    except Exception as err:
        future.set_exception(err)
        return
    if not isinstance(result, asyncio.Future):
        future.set_result(result)
        return

    def done(inner: asyncio.Future[bytes]) -> None:
        if future.done():
            return
        if inner.cancelled():
            future.cancel()
        elif inner.exception() is not None:
            future.set_exception(inner.exception())  # type: ignore[arg-type]
        else:
            future.set_result(inner.result())

    result.add_done_callback(done)
    future.add_done_callback(lambda f: result.cancel() if f.cancelled() else None)


#: The oldest memory waiters a picker lists in its load reports (:meth:`Admission.memory_waiters`).
WAITERS_REPORTED = 16


class _Waiter:
    __slots__ = ("future", "resume", "timer", "fits", "mib", "since", "id")

    def __init__(self, future: asyncio.Future, resume: Callable[[], bytes | asyncio.Future[bytes]],
                 fits: Callable[[], bool], mib: float, since: float, waiter_id: int) -> None:
        self.future = future
        self.resume = resume
        self.fits = fits
        self.mib = mib
        self.since = since
        self.id = waiter_id
        self.timer: asyncio.TimerHandle | None = None


class Admission:
    """Per-cluster queues of requests waiting for a slot or for GPU memory.

    No defaults here: they are the picker config's (``picker.max_queue``, ``picker.queue_timeout_s``,
    ``picker.retry_after_s``), one place for each.

    Args:
        max_queue: waiting requests per cluster (0 = never queue: 429 at once).
        timeout_s: longest wait (s); then 429.
        retry_after_s: the ``Retry-After`` value of a 429 (whole seconds, >= 1).

    Raises:
        ValueError: a negative ``max_queue``, ``timeout_s`` <= 0 or ``retry_after_s`` < 1.
    """

    def __init__(self, max_queue: int, timeout_s: float, retry_after_s: int) -> None:
        if max_queue < 0 or timeout_s <= 0 or retry_after_s < 1:
            raise ValueError(f"admission: max_queue >= 0, timeout_s > 0, retry_after_s >= 1 needed; got "
                             f"{max_queue}, {timeout_s}, {retry_after_s}")
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._queues: dict[str, deque[_Waiter]] = {}
        self._ids = itertools.count(1)

    def queued(self, cluster: str) -> int:
        """Requests waiting for ``cluster`` now."""
        queue = self._queues.get(cluster)
        return len(queue) if queue else 0

    def waiting(self) -> bool:
        """Whether any request waits now (any cluster)."""
        return any(self._queues.values())

    def memory_waiters(self) -> list[tuple[int, str, float, float]]:
        """The requests waiting for GPU memory now, ``[(waiter id, cluster, MiB, waited s)]``, oldest
        first, at most :data:`WAITERS_REPORTED` (for the shared load view's reports; the event loop's
        clock). O(waiting requests)."""
        if not self.waiting():
            return []
        now = asyncio.get_running_loop().time()
        waiters = sorted((w for queue in self._queues.values() for w in queue if w.mib > 0 and not w.future.done()),
                         key=lambda w: (w.since, w.id))[:WAITERS_REPORTED]
        cluster_of = {id(w): c for c, queue in self._queues.items() for w in queue}
        return [(w.id, cluster_of[id(w)], w.mib, max(0.0, now - w.since)) for w in waiters]

    def enqueue(self, cluster: str, resume: Callable[[], bytes | asyncio.Future[bytes]], reject: Callable[[], bytes],
                fits: Callable[[], bool], timeout_s: float | None = None, mib: float = 0.0,
                since: float | None = None) -> asyncio.Future:
        """Queue a request (the caller checked :func:`admit` said "queue", or no endpoint has memory).

        Args:
            cluster: the full cluster.
            resume: called right after ``fits`` said yes (in the same :meth:`release`); commits the
                request and returns the answer bytes (or a future of them: see :func:`settle`).
            reject: called on timeout; returns the 429 answer bytes.
            fits: whether an endpoint has the memory for it now (asked by :meth:`release` when
                the cluster has a slot).
            timeout_s: how long it may wait (s; None: :attr:`timeout_s`).
            mib: its GPU memory need when it waits for memory (MiB; 0: it waits for a slot).
            since: when it began to wait (the event loop's time; None: now): a request released and
                sent back keeps its place (:meth:`memory_waiters`).

        Returns:
            A future resolved with the answer bytes. Cancel it when the stream ends first.
        """
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), resume, fits, mib, loop.time() if since is None else since,
                         next(self._ids))
        queue = self._queues.setdefault(cluster, deque())
        queue.append(waiter)
        QUEUED.labels(cluster).set(len(queue))
        ADMISSION.labels(cluster, "queued").inc()

        def expire() -> None:
            if not waiter.future.done():
                ADMISSION.labels(cluster, "rejected_timeout").inc()
                waiter.future.set_result(reject())
            self._drop(cluster, waiter)

        waiter.timer = loop.call_later(self.timeout_s if timeout_s is None else max(0.0, timeout_s), expire)
        return waiter.future

    def _drop(self, cluster: str, waiter: _Waiter) -> None:
        queue = self._queues.get(cluster)
        if queue is not None:
            try:
                queue.remove(waiter)
            except ValueError:
                pass
            QUEUED.labels(cluster).set(len(queue))

    def release(self, room: Callable[[str], bool]) -> int:
        """Admit waiting requests while their cluster has a slot (``room(cluster)``): per cluster the
        oldest that ``fits`` goes first; one that does not fit yet (a large request) lets a later
        one that does go by (backfill), looking at most :data:`BACKFILL` waiters deep.

        ``resume`` of each admitted request counts it in flight, so the next ``room`` and ``fits``
        see it. Returns how many were admitted.
        """
        admitted = 0
        for cluster, queue in self._queues.items():
            while queue and room(cluster):
                chosen = next((w for w in itertools.islice(queue, BACKFILL) if w.future.done() or w.fits()), None)
                if chosen is None:
                    break
                queue.remove(chosen)
                if chosen.timer is not None:
                    chosen.timer.cancel()
                if chosen.future.done():  # cancelled: the stream went away
                    ADMISSION.labels(cluster, "cancelled").inc()
                    continue
                settle(chosen.future, chosen.resume)  # an exception: the transport answers an error status
                ADMISSION.labels(cluster, "admitted").inc()
                admitted += 1
            QUEUED.labels(cluster).set(len(queue))
        return admitted
