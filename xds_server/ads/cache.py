"""The snapshots the ADS streams serve: one per node group, validated, published after a debounce.

- Node groups: Envoys whose ``node.cluster`` names a group with its own snapshot get that one; every
  other Envoy gets the default group's (``None``).
- Validation: :func:`xds_server.ads.validate.guard` runs on every ``set``; a rejected resource is
  logged, counted (``inferlb_xds_rejected_resources_total``) and replaced by its last good version.
- Debounce and coalescing: a new snapshot is published once no newer one arrived for ``debounce_s``,
  and at most ``debounce_max_s`` after the first unpublished one; snapshots set in between are
  never published (only the newest counts). A group's first snapshot is published at once.
  Each stream then sends the newest published snapshot when it is free (one push in flight per
  stream; a slow stream skips intermediate snapshots and never holds up the others).
- Wake-ups: a publication sets the :class:`asyncio.Event` of every listening stream
  (:meth:`SnapshotCache.listen`): one wake-up per stream, which then reads the snapshot itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from prometheus_client import Counter

from xds_server.ads.validate import Rejection, guard
from xds_server.snapshot import Snapshot

log = logging.getLogger(__name__)

REJECTED = Counter("inferlb_xds_rejected_resources_total", "Resources that failed validation and were not sent",
                   ["type"])
PUBLISHED = Counter("inferlb_xds_published_snapshots_total", "Snapshots published to the ADS streams")
COALESCED = Counter("inferlb_xds_coalesced_snapshots_total", "Snapshots replaced by a newer one before publication")


def publish_at(first_pending: float, last_set: float, debounce_s: float, debounce_max_s: float) -> float:
    """When pending snapshots are due (same clock as the arguments, s): ``debounce_s`` after the last
    ``set``, but no later than ``debounce_max_s`` after the first unpublished one."""
    return min(last_set + debounce_s, first_pending + debounce_max_s)


class SnapshotCache:
    """Validated snapshots per node group; streams :meth:`listen` for publications.

    ``debounce_s``/``debounce_max_s``: see the module docstring (0 = publish at once).
    ``rejections``: the newest validation rejections (up to 100), for the admin API.
    """

    def __init__(self, debounce_s: float = 0.1, debounce_max_s: float = 1.0) -> None:
        self.debounce_s = debounce_s
        self.debounce_max_s = debounce_max_s
        self.generation = 0
        self.rejections: collections.deque[Rejection] = collections.deque(maxlen=100)
        self._published: dict[str | None, Snapshot] = {}
        self._latest: dict[str | None, Snapshot] = {}
        self._first_pending: float | None = None
        self._last_set = 0.0
        self._timer: asyncio.Task | None = None
        self._listeners: set[asyncio.Event] = set()
        self._set_lock = asyncio.Lock()

    @property
    def snapshot(self) -> Snapshot | None:
        """The default group's published snapshot (None before the first)."""
        return self._published.get(None)

    def latest(self, group: str | None = None) -> Snapshot | None:
        """The newest validated snapshot of ``group``, published or still in its debounce window."""
        return self._latest.get(group)

    def snapshot_for(self, node_cluster: str) -> Snapshot | None:
        """The published snapshot an Envoy of ``node.cluster`` gets: its group's, else the default."""
        snap = self._published.get(node_cluster)
        return snap if snap is not None else self._published.get(None)

    async def set(self, snap: Snapshot, group: str | None = None) -> Snapshot:
        """Validate ``snap`` against the group's last good one and schedule its publication.

        Returns the snapshot that will be served (``snap`` minus rejected resources). The check of
        the changed resources (every endpoint of every new ClusterLoadAssignment) runs in a worker
        thread, one ``set`` at a time, so a 60 000-endpoint assignment does not stall the event loop.
        """
        async with self._set_lock:
            return await self._set(snap, group)

    async def _set(self, snap: Snapshot, group: str | None) -> Snapshot:
        served, rejected = await asyncio.to_thread(guard, snap, self._latest.get(group))
        for r in rejected:
            REJECTED.labels(r.type_url.rsplit(".", 1)[-1]).inc()
            self.rejections.append(r)
            log.error("not sending %s %s (version %s): %s; serving %s", r.type_url.rsplit(".", 1)[-1], r.name,
                      r.version, "; ".join(r.problems), f"version {r.kept}" if r.kept else "nothing for it")
        current = self._latest.get(group)
        if current is not None and current.version == served.version:
            return current
        self._latest[group] = served
        if group not in self._published or self.debounce_max_s == 0:
            self._publish()
            return served
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._first_pending is None:
            self._first_pending = now
        else:
            COALESCED.inc()
        self._last_set = now
        if self._timer is None or self._timer.done():
            self._timer = loop.create_task(self._publish_when_due())
        return served

    async def _publish_when_due(self) -> None:
        loop = asyncio.get_running_loop()
        while self._first_pending is not None:
            delay = publish_at(self._first_pending, self._last_set, self.debounce_s, self.debounce_max_s) - loop.time()
            if delay <= 0:
                self._publish()
                return
            await asyncio.sleep(delay)

    def _publish(self) -> None:
        self._first_pending = None
        changed = {g: s for g, s in self._latest.items() if self._published.get(g) is not s}
        if not changed:
            return
        self._published.update(changed)
        self.generation += 1
        PUBLISHED.inc(len(changed))
        for wake in self._listeners:
            wake.set()

    def listen(self, wake: asyncio.Event) -> None:
        """Set ``wake`` at every publication from now on (a publication increments ``generation``),
        until :meth:`unlisten`."""
        self._listeners.add(wake)

    def unlisten(self, wake: asyncio.Event) -> None:
        """Stop setting ``wake`` (a no-op when it was not listening)."""
        self._listeners.discard(wake)
