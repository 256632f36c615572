"""The picker's metrics and its rate-limited error log.

Metrics live on prometheus_client's default registry:
- ``inferlb_ext_proc_decisions_total{outcome, plugins}``: decisions by :attr:`Decision.reason` and
  the scheduling plugins that decided them (:attr:`Decision.plugins`, "" for outcomes no profile
  decides: rejections, pin moves, grants; a bounded set per profile:
  :meth:`ext_proc.scheduling.Profile.label`). Counted per request in a plain dict
  (:data:`OUTCOMES`, no lock: prometheus_client's own counters take one per increment) and read at
  scrape time.
- ``inferlb_ext_proc_errors_total{kind}``: malformed or unexpected input and internal errors.
- ``inferlb_ext_proc_decision_seconds``: time spent in ``pick`` (seconds; buckets from 1 µs),
  sampled: one decision in :data:`SAMPLE_EVERY`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["DECISION_SECONDS", "ERRORS", "OUTCOMES", "SAMPLE_EVERY", "ErrorReporter"]

OUTCOMES: dict[tuple[str, str], int] = {}
"""Decisions by ``(outcome, plugins)``, incremented on the request path (one event loop per picker process)."""

SAMPLE_EVERY = 64
"""One decision in this many is timed into ``inferlb_ext_proc_decision_seconds``."""


class _Outcomes(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("inferlb_ext_proc_decisions",
                                     "ext_proc picker decisions by outcome (the decision reason) and the scheduling "
                                     "plugins that decided them.", labels=["outcome", "plugins"])
        for (outcome, plugins), n in sorted(OUTCOMES.items()):
            family.add_metric([outcome, plugins], n)
        yield family


REGISTRY.register(_Outcomes())
ERRORS = Counter(
    "inferlb_ext_proc_errors_total",
    "ext_proc requests that were malformed, unexpected or failed inside the picker, by kind.",
    ["kind"],
)
DECISION_SECONDS = Histogram(
    "inferlb_ext_proc_decision_seconds",
    "Time spent deciding one request (headers already parsed), in seconds.",
    buckets=(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 1e-3, 1e-2),
)


class ErrorReporter:
    """Counts every error and logs each kind at most once per ``interval`` seconds.

    The first occurrence of a kind is logged at once; later ones within the interval are only
    counted, and the next log line says how many were suppressed. Not thread-safe: use one per
    event loop (the picker runs on one).

    Args:
        logger: where to log (WARNING level).
        interval: seconds between two log lines of the same kind.
    """

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def report(self, kind: str, message: str, *, exc_info: bool = False) -> None:
        """Count one error of ``kind`` and maybe log ``message``."""
        ERRORS.labels(kind).inc()
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        more = f" ({suppressed} more of this kind since the last report)" if suppressed else ""
        self._logger.warning("ext_proc %s: %s%s", kind, message, more, exc_info=exc_info)
