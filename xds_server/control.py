"""The slow loop: every interval, metrics -> weight engine -> snapshot -> (ADS, picker view, history).

The thin I/O shell around the pure parts. Metrics are fetched in a worker thread with a deadline;
when the source fails, the last good weights keep serving and the failure is flagged (case C05).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import MappingProxyType

from prometheus_client import Counter, Gauge

from .ads.cache import SnapshotCache
from .config import Config, cluster_name
from .engine.pipeline import compute_weights
from .engine.types import EndpointSpec, EndpointWeight, EngineParams, EngineState
from .metrics.prometheus import MetricsUnavailable
from .metrics.stats import EndpointStats
from .snapshot import BuildMemo, Snapshot, build_snapshot

log = logging.getLogger(__name__)

METRICS_UP = Gauge("inferlb_metrics_source_up", "1 when the last metrics round succeeded")
ROUNDS = Counter("inferlb_weight_rounds_total", "Weight-engine rounds, by outcome", ["outcome"])
SNAPSHOTS = Counter("inferlb_snapshots_total", "New snapshots published")


def endpoint_specs(cfg: Config) -> list[EndpointSpec]:
    """The engine's view of every configured endpoint."""
    return [
        EndpointSpec(
            cluster=cluster_name(s.name, v.name),
            address=e.address,
            instance=e.instance,
            gpu_class=e.gpu_class,
            capacity=cfg.gpu_classes[e.gpu_class].capacity,
            max_concurrency=e.max_concurrency,
            memory_mib=cfg.memory_mib(e),
        )
        for s in cfg.services
        for v in s.versions
        for e in v.endpoints
    ]


def engine_params(cfg: Config) -> EngineParams:
    """Engine parameters from the config."""
    e = cfg.engine
    return EngineParams(
        stale_after_s=e.stale_after_s,
        request_memory_mib=e.request_memory_mib,
        memory_margin=e.memory_margin,
        max_weight=e.max_weight,
        hysteresis=e.hysteresis,
        scorer_weights=MappingProxyType(e.scorers.model_dump()),
    )


class ControlPlane:
    """Runs weight rounds and publishes each new snapshot to ``cache`` and to ``on_snapshot`` hooks.

    A hook is called as ``hook(snapshot, weights)`` (weights: the round's ``EndpointWeight`` list)
    on the event loop, once per new snapshot; it must not block (hand slow work to a thread).

    ``fetch``: blocking ``(instances) -> {instance: EndpointStats}`` raising MetricsUnavailable;
    ``ext_proc_address``: returns the picker's bound ``HOST:PORT`` (known once it has started).
    """

    def __init__(self, cfg: Config, fetch: Callable[[list[str]], dict[str, EndpointStats]], source_name: str,
                 cache: SnapshotCache, on_snapshot: list[Callable[[Snapshot, list[EndpointWeight]], None]],
                 ext_proc_address: Callable[[], str]) -> None:
        self.cfg = cfg
        self._ext_proc_address = ext_proc_address
        self._fetch = fetch
        self.source_name = source_name
        self.cache = cache
        self._hooks = on_snapshot
        self._specs = endpoint_specs(cfg)
        self._params = engine_params(cfg)
        self._state = EngineState()
        self._memo = BuildMemo()
        self._group_cfgs = {g: cfg.for_node_group(g) for g in cfg.node_groups}
        self.weights: list[EndpointWeight] = []
        self.metrics_ok: bool | None = None
        self.last_round_at: float | None = None
        self.ready = asyncio.Event()

    async def run_round(self) -> None:
        """One round. On a metrics failure the previous weights stay (first round: neutral weights)."""
        instances = [s.instance for s in self._specs]
        try:
            stats = await asyncio.wait_for(asyncio.to_thread(self._fetch, instances),
                                           timeout=self.cfg.prometheus.timeout_s * 3)
            ok = True
        except (MetricsUnavailable, TimeoutError) as err:
            ok = False
            stats = {}
            if self.metrics_ok is not False:
                log.error("metrics source failed: %s; keeping the last good weights", err or "timeout")
        self.metrics_ok = ok
        METRICS_UP.set(1 if ok else 0)
        ROUNDS.labels("ok" if ok else "metrics_unavailable").inc()
        self.last_round_at = time.time()
        if not ok and self.weights:
            return
        weights, self._state = compute_weights(self._specs, stats, self._state, self._params)
        self._log_changes(weights)
        self.weights = weights
        ext_proc = self._ext_proc_address()
        await self._publish(build_snapshot(self.cfg, weights, ext_proc, self._memo), weights)
        for group, group_cfg in self._group_cfgs.items():  # node-specific views (config node_groups)
            await self.cache.set(build_snapshot(group_cfg, weights, ext_proc, self._memo), group)

    def _log_changes(self, weights: list[EndpointWeight]) -> None:
        before = {(w.cluster, w.address): (w.weight, w.health) for w in self.weights}
        for w in weights:
            if before.get((w.cluster, w.address)) != (w.weight, w.health):
                log.info("weight %s %s -> %d %s: %s", w.cluster, w.address, w.weight, w.health,
                         "; ".join(w.reasons))

    async def _publish(self, snap: Snapshot, weights: list[EndpointWeight]) -> None:
        current = self.cache.latest()
        if current is not None and current.version == snap.version:
            return
        for hook in self._hooks:
            hook(snap, weights)
        await self.cache.set(snap)
        SNAPSHOTS.inc()
        self.ready.set()

    async def run(self) -> None:
        """Rounds forever, every ``prometheus.interval_s`` seconds."""
        while True:
            started = time.monotonic()
            try:
                await self.run_round()
            except Exception:  # a bug in one round must not stop the loop: last good snapshot stays
                log.exception("weight round failed; the last good snapshot keeps serving")
                ROUNDS.labels("error").inc()
            await asyncio.sleep(max(0.0, self.cfg.prometheus.interval_s - (time.monotonic() - started)))
