"""The ``status`` metrics source: the status snapshot each node keeps in its etcd registration.

A node registered in etcd (see :mod:`xds_server.discovery.etcd`) rewrites its registration every
few seconds (the simulator: every 5 s) with a ``status`` object: running and waiting requests,
KV-cache use (0–1), free GPU memory (MiB), GPU utilisation (0–1). The etcd watcher hands each
snapshot to :meth:`StatusSource.set` as it arrives; :meth:`StatusSource.fetch` reports it with
``sample_age_s`` = time since it arrived (the watcher's clock, not the node's), so a node that stops
refreshing goes stale like any other source, and one whose key is gone (:meth:`StatusSource.discard`)
has no status at all. A snapshot with a bad value is refused whole and counted.

Thread-safety: the watcher runs on the event loop, ``fetch`` in the round's worker thread; one lock
guards the table.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import Counter

from xds_server.metrics.stats import EndpointStats

SNAPSHOTS = Counter("inferlb_node_status_snapshots_total", "Status snapshots read from etcd registrations, "
                    "by outcome", ["outcome"])

#: status field (as nodes write it) -> EndpointStats field.
FIELDS = {"running": "running", "waiting": "queue", "gpu_memory_free_mib": "gpu_mem_free_mib",
          "kv_cache_usage": "kv_cache", "gpu_utilization": "gpu_util"}
#: Fields that are a fraction 0–1.
FRACTIONS = ("kv_cache_usage", "gpu_utilization")


class BadSnapshot(ValueError):
    """A status snapshot that cannot be used; ``field`` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def snapshot_stats(doc: Any) -> EndpointStats:
    """A status object (``{"running": 2, "waiting": 0, "kv_cache_usage": 0.1, ...}``) -> EndpointStats.

    Unknown keys (``at``, say) are ignored; missing ones are "no data". ``in_flight`` = running +
    waiting when both are present.

    Raises:
        BadSnapshot: not an object, or a value that is not a finite number >= 0 (or a 0–1 value above 1).
    """
    if not isinstance(doc, Mapping):
        raise BadSnapshot("status", f"status must be an object, got {type(doc).__name__}")
    values: dict[str, float] = {}
    for name, field in FIELDS.items():
        if name not in doc or doc[name] is None:
            continue
        v = doc[name]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise BadSnapshot(f"status.{name}", f"status.{name} must be a finite number >= 0, got {v!r}")
        if name in FRACTIONS and v > 1:
            raise BadSnapshot(f"status.{name}", f"status.{name} is a fraction 0-1, got {v!r}")
        values[field] = float(v)
    if "running" in values and "queue" in values:
        values["in_flight"] = values["running"] + values["queue"]
    return EndpointStats(**values)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The newest status of one instance and when it arrived (``time.time()`` s)."""

    at: float
    stats: EndpointStats


class StatusSource:
    """The newest status snapshot of each registered instance (``HOST:PORT``), fed by the etcd watcher."""

    name = "status"

    def __init__(self) -> None:
        self._latest: dict[str, Snapshot] = {}
        self._lock = threading.Lock()
        self.accepted = 0
        self.rejected = 0

    def set(self, instance: str, stats: EndpointStats, at: float | None = None) -> None:
        """Keep ``stats`` as the newest status of ``instance`` (received at ``at``, default now)."""
        with self._lock:
            self._latest[instance] = Snapshot(time.time() if at is None else at, stats)
        self.accepted += 1
        SNAPSHOTS.labels("accepted").inc()

    def refuse(self) -> None:
        """Count a snapshot that could not be used (the caller logs why)."""
        self.rejected += 1
        SNAPSHOTS.labels("rejected").inc()

    def discard(self, instance: str) -> None:
        """``instance`` is no longer registered: forget its status."""
        with self._lock:
            self._latest.pop(instance, None)

    def retain(self, instances: Iterable[str]) -> None:
        """Forget every instance not in ``instances`` (after a full list of the registrations)."""
        keep = set(instances)
        with self._lock:
            self._latest = {i: s for i, s in self._latest.items() if i in keep}

    def fetch(self, instances: Iterable[str], now: float | None = None) -> dict[str, EndpointStats]:
        """``{instance: stats with sample_age_s}`` for the instances with a snapshot (no I/O)."""
        now = time.time() if now is None else now
        with self._lock:
            latest = dict(self._latest)
        return {inst: replace(s.stats, sample_age_s=max(0.0, now - s.at))
                for inst in instances if (s := latest.get(inst)) is not None}

    def describe(self) -> dict:
        """Counters and the instances with a snapshot, for the admin API."""
        with self._lock:
            known = sorted(self._latest)
        return {"accepted": self.accepted, "rejected": self.rejected, "instances": known}
