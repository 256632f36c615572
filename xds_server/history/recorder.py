"""The history's I/O shell: a ControlPlane hook that only enqueues, and a writer thread that records.

The event loop never touches the database: :meth:`HistoryRecorder.record` puts the round on a
bounded queue (a full queue drops the round, counted) and returns. The writer thread diffs each
round against what it recorded last (:func:`~xds_server.history.changes.to_record`), appends the
rows, prunes retention now and then, and writes keyframes for endpoints that have not changed for
``keyframe_s`` by reading the control plane's current weights. A failing database is logged
(at most once a minute) and counted; the control plane keeps running.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from xds_server.engine.types import EndpointWeight
from xds_server.history.changes import LastRecorded, last_recorded, to_record
from xds_server.history.types import CHANGE, KEYFRAME, HistoryError, HistoryStore
from xds_server.snapshot import Snapshot

log = logging.getLogger(__name__)

ROWS_WRITTEN = Counter("inferlb_history_rows_written_total", "Weight-history rows written, by kind", ["kind"])
ERRORS = Counter("inferlb_history_errors_total", "Weight-history store failures, by operation", ["op"])
DROPPED = Counter("inferlb_history_dropped_rounds_total",
                  "Rounds not recorded because the history writer's queue was full")

_STOP = object()
Current = Callable[[], tuple[str | None, Sequence[EndpointWeight]]]


class HistoryRecorder:
    """Writes weight and health changes (and keyframes) to a :class:`HistoryStore` from its own thread.

    Args:
        store: where rows go.
        keyframe_s: an unchanged endpoint gets a row at least this often (s).
        current: ``() -> (snapshot_version, weights)`` of the control plane now; polled from the writer
            thread for keyframes (None: keyframes only when a round is recorded).
        clock: Unix time source (s).
        prune_every_s: how often retention is applied (s).
        max_queue: rounds waiting to be written before new ones are dropped.
    """

    def __init__(self, store: HistoryStore, keyframe_s: float, current: Current | None = None, *,
                 clock: Callable[[], float] = time.time, prune_every_s: float = 60.0,
                 max_queue: int = 1024) -> None:
        self.store = store
        self._keyframe_s = keyframe_s
        self._current = current
        self._clock = clock
        self._prune_every_s = prune_every_s
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._run, name="inferlb-history", daemon=True)
        self._last = LastRecorded({})
        self._last_error_log = float("-inf")

    def start(self) -> None:
        """Start the writer thread (it first reads what was recorded last, so a restart continues)."""
        self._thread.start()

    def record(self, snap: Snapshot, weights: Sequence[EndpointWeight]) -> None:
        """ControlPlane hook: enqueue this round (never blocks, never raises)."""
        try:
            self._queue.put_nowait((self._clock(), snap.version, weights))
        except queue.Full:
            DROPPED.inc()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything enqueued so far is written; False on timeout."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, stop the thread, close the store."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
        self.store.close()

    def _run(self) -> None:
        stored = self._guard("read", lambda: self.store.last_before(float("inf"))) or []
        self._last = LastRecorded.of(last_recorded(stored))
        check_every = min(self._keyframe_s / 2, 30.0)
        next_check = time.monotonic() + check_every
        next_prune = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is not None:
                now, version, weights = item
                item = None
                self._write(now, version, weights, False)
                weights = None  # hold no round while waiting
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every
                if self._current is not None:
                    version, weights = self._current()
                    self._write(self._clock(), version, weights, True)
                    weights = None
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + self._prune_every_s
                self._guard("prune", lambda: self.store.prune(self._clock()))

    def _write(self, now: float, version: str | None, weights: Sequence[EndpointWeight],
               keyframes_only: bool) -> None:
        rows, last = to_record(weights, self._last, now, version, self._keyframe_s, keyframes_only)
        if not rows:
            return
        try:
            self.store.append(rows)
        except HistoryError as err:
            self._failed("write", err)  # _last stays: the change is written with a later round
            return
        self._last = last
        changes = rows.kind.count(CHANGE)  # one C-level count (a Counter walks 35 000 rows in Python)
        for kind, count in ((CHANGE, changes), (KEYFRAME, len(rows) - changes)):
            if count:
                ROWS_WRITTEN.labels(kind).inc(count)

    def _guard(self, op: str, fn: Callable):
        try:
            return fn()
        except HistoryError as err:
            self._failed(op, err)
            return None

    def _failed(self, op: str, err: HistoryError) -> None:
        ERRORS.labels(op).inc()
        if time.monotonic() - self._last_error_log >= 60:
            self._last_error_log = time.monotonic()
            log.error("history %s failed (the control plane keeps running): %s", op, err)
