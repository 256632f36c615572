"""The slow loop: every interval, metrics -> weight engine -> snapshot -> (ADS, picker view, history).

The thin I/O shell around the pure parts. Metrics are fetched in a worker thread with a deadline;
when the source fails, the last good weights keep serving and the failure is flagged (case C05).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from prometheus_client import Counter, Gauge

from xds_server.ads.cache import SnapshotCache
from xds_server.config import Config, cluster_name
from xds_server.config.model import STALE_INTERVALS, stale_message
from xds_server.engine import settings
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EndpointSpec, EngineParams, EngineState
from xds_server.engine.verdicts import EVERY_DRAINING, EVERY_REMOVED, Verdicts, unserved
from xds_server.metrics.source import MetricsSource, MetricsUnavailable
from xds_server.metrics.stats import EndpointStats
from xds_server.resources.build import BuildMemo, build_snapshot
from xds_server.snapshot import Snapshot

log = logging.getLogger(__name__)

METRICS_UP = Gauge("inferlb_metrics_source_up", "1 when the last metrics round succeeded")
ROUNDS = Counter("inferlb_weight_rounds_total", "Weight-engine rounds, by outcome", ["outcome"])
#: Most per-endpoint change lines logged per round.
MAX_CHANGE_LINES = 200
SNAPSHOTS = Counter("inferlb_snapshots_total", "New snapshots published")
UNSERVED = Gauge("inferlb_cluster_unserved", "1 while a cluster has no healthy endpoint (every endpoint draining, "
                 "removed or unhealthy)", ["cluster"])
UNSERVED_TOTAL = Counter("inferlb_cluster_unserved_episodes_total",
                         "Times a cluster was left without a healthy endpoint", ["cluster"])


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
            draining=e.drain,
            tier=e.tier,
            preallocated=cfg.preallocates(v),
        )
        for s in cfg.services
        for v in s.versions
        for e in v.endpoints
    ]


def engine_params(cfg: Config) -> EngineParams:
    """Engine parameters from the config."""
    e = cfg.engine
    return settings.engine_params(
        stale_after_s=e.stale_after_s, request_memory_mib=e.request_memory_mib, memory_margin=e.memory_margin,
        max_weight=e.max_weight, hysteresis=e.hysteresis, quantum=e.quantum, max_change=e.max_change,
        drain_timeout_s=e.drain_timeout_s, filters=e.filters, scorers=e.scorers, factors=e.factors,
        health_rounds=e.health_rounds,
    )


class ControlPlane:
    """Runs weight rounds and publishes each new snapshot to ``cache`` and to ``on_snapshot`` hooks.

    A hook is called as ``hook(snapshot, weights)`` (weights: the round's :class:`~xds_server.engine.verdicts.Verdicts`)
    on the event loop, once per new snapshot; it must not block: slow work goes to a thread, and a
    hook may return an awaitable (e.g. ``run_in_executor``'s future), which is awaited in order.

    ``source``: the metrics source (its blocking ``fetch(instances)`` raises MetricsUnavailable);
    ``ext_proc_address``: returns the picker's bound ``HOST:PORT`` (known once it has started);
    ``picker_metadata(cfg)``: the picker cluster's ``filter_metadata`` (see
    :class:`~xds_server.resources.build.BuildMemo`). ``on_round``: hooks called with every round's
    weights (their ``inputs`` are that round's stats), snapshot or not, on the event loop; they must
    not block (like ``on_snapshot`` hooks, one may return an awaitable). ``round_context``: a context
    manager factory entered around each round's computation and publication (``inferlb serve``
    keeps the cyclic GC out of the round with it); none by default.

    Hooks see only what the cache accepted: the snapshot it validated (rejected resources replaced by
    their last good versions), after it was set, so history never records a version Envoy never got.

    Nothing is published before the first successful metrics round, or before
    ``loop.first_round_wait_s`` has passed without one (then neutral weights go out, flagged):
    so a restarted control plane never replaces Envoy's last good weights with guesses.
    """

    def __init__(self, cfg: Config, source: MetricsSource, cache: SnapshotCache,
                 on_snapshot: list[Callable[[Snapshot, Verdicts], None]],
                 ext_proc_address: Callable[[], str],
                 picker_metadata: Callable[[Config], Mapping[str, Any]] | None = None,
                 on_round: list[Callable[[Verdicts], Any]] | None = None,
                 round_context: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.cfg = cfg
        self._round_hooks = on_round or []
        self._round_context = round_context
        self._ext_proc_address = ext_proc_address
        self.source = source
        self.cache = cache
        self._hooks = on_snapshot
        self._specs = endpoint_specs(cfg)
        self._spec_of = {(s.cluster, s.address): s for s in self._specs}
        self._params = engine_params(cfg)
        self._state = EngineState()
        self._memo = BuildMemo(picker_metadata)
        self._group_cfgs = {g: cfg.for_node_group(g) for g in cfg.node_groups}
        self._stats: dict[str, EndpointStats] = {}
        self._draining: set[str] = set()
        self._created = time.monotonic()
        self._lock = asyncio.Lock()
        self.weights = Verdicts([])
        """The last round's verdicts (a ``Sequence[EndpointWeight]``)."""
        self.unserved: dict[str, str] = {}
        """``{cluster: why, and what Envoy does with its requests}``: the clusters the last round left
        without a healthy endpoint (:func:`~xds_server.engine.verdicts.unserved`; ``/readyz`` and
        ``/api/v1/weights`` show them)."""
        self.metrics_ok: bool | None = None
        self.last_round_at: float | None = None
        self.stats_at: float | None = None
        """When the current stats were fetched (monotonic s): their ``sample_age_s`` count from here.
        Read in the fetch's own thread as it returns: on a busy event loop, the hand-back to the loop
        can take tens of ms, and the picker's memory estimate dates each sample from this."""
        self.ready = asyncio.Event()

    @property
    def source_name(self) -> str:
        """The metrics source(s) the last round used, e.g. ``prometheus``, ``scrape``, ``prometheus+push``."""
        return self.source.name

    @property
    def specs(self) -> Sequence[EndpointSpec]:
        """The engine's view of every configured endpoint (a new object after each reconfiguration)."""
        return self._specs

    def spec(self, cluster: str, address: str) -> EndpointSpec | None:
        """The engine's view of one configured endpoint."""
        return self._spec_of.get((cluster, address))

    @property
    def addresses(self) -> set[str]:
        """Every configured endpoint address (``HOST:PORT``)."""
        return {s.address for s in self._specs}

    @property
    def draining(self) -> frozenset[str]:
        """Addresses set to drain through :meth:`set_draining`."""
        return frozenset(self._draining)

    def reconfigure(self, cfg: Config, source: MetricsSource | None = None) -> None:
        """Take a new (already validated) config: endpoints, engine parameters, Envoy side, headers.

        The engine's memory (last weights) is kept for endpoints that stay, so weights don't jump;
        drains of endpoints that are gone are forgotten. Publishes nothing: call :meth:`republish`.
        """
        self.cfg = cfg
        self._specs = endpoint_specs(cfg)
        self._spec_of = {(s.cluster, s.address): s for s in self._specs}
        self._params = engine_params(cfg)
        self._group_cfgs = {g: cfg.for_node_group(g) for g in cfg.node_groups}
        self._draining &= self.addresses
        if source is not None:
            self.source = source

    async def set_draining(self, address: str, draining: bool = True) -> bool:
        """Mark ``address`` DRAINING (or back) in every cluster and publish at once (case C11).

        Returns False (and changes nothing) when no configured endpoint has that address.
        """
        if address not in self.addresses:
            return False
        if draining:
            self._draining.add(address)
        else:
            self._draining.discard(address)
        log.info("endpoint %s %s", address, "set to drain" if draining else "no longer draining")
        await self.republish()
        return True

    async def republish(self) -> None:
        """Recompute from the last metrics round's stats and publish (drain, reload). No metrics query.

        Before the first snapshot this does nothing: the first round decides what goes out first.
        """
        if not self.ready.is_set():
            return
        await self._compute_and_publish(self._stats)

    async def _compute_and_publish(self, stats: dict[str, EndpointStats]) -> None:
        # The engine and the snapshot build are pure and O(endpoints): they run in a worker thread so
        # the event loop (ADS streams, the picker, the admin API) keeps answering during a round of
        # 60 000 endpoints (issue 15, scale). The lock keeps one round at a time.
        async with self._lock:
            with self._round_context():
                configured, params, state, cfg = self._specs, self._params, self._state, self.cfg
                draining, now = frozenset(self._draining), time.monotonic()

                def decide() -> Verdicts:
                    specs = [replace(s, draining=True) if s.address in draining else s for s in configured]
                    weights, new_state = compute_weights(specs, stats, state, params, now=now, plugins=BUILTIN)
                    self._log_changes(weights)
                    # Swapped here, not on the loop: freeing the previous round's state holds the GIL.
                    self.weights, self._state = weights, new_state
                    return weights

                weights = await asyncio.to_thread(decide)
                self._warn_unserved(unserved(weights))
                for hook in self._round_hooks:
                    done = hook(weights)
                    if inspect.isawaitable(done):
                        await done
                ext_proc = self._ext_proc_address()
                groups = self._group_cfgs

                def build() -> tuple[Snapshot, dict[str, Snapshot]]:
                    served = weights.served()
                    return (build_snapshot(cfg, served, ext_proc, self._memo),
                            {g: build_snapshot(gc, served, ext_proc, self._memo) for g, gc in groups.items()})

                main, per_group = await asyncio.to_thread(build)
                await self._publish(main, weights)
                for group, snap in per_group.items():  # node-specific views (config node_groups)
                    await self.cache.set(snap, group)

    def _consequence(self, cluster: str, why: str) -> str:
        """What Envoy does with ``cluster``'s requests while it has no healthy endpoint (``why``): 503 ``no
        healthy upstream`` when every endpoint is draining (the assignment withdraws them:
        :meth:`xds_server.resources.build.BuildMemo.assignment`) or was removed; with unhealthy ones
        among them and the service's ``panic_threshold_percent`` above 0, Envoy's panic mode sends the
        requests to the endpoints it still lists."""
        panic = next((svc.panic_threshold_percent for svc in self.cfg.services
                      if any(cluster_name(svc.name, v.name) == cluster for v in svc.versions)), 0.0)
        if panic > 0 and why not in (EVERY_DRAINING, EVERY_REMOVED):  # endpoints listed, none healthy
            return (f"{why}; Envoy's panic mode (panic_threshold_percent {panic:g}) still sends its requests to "
                    f"them, 503 no healthy upstream once none is left (0 refuses them at once)")
        return f"{why}; Envoy answers its requests 503 no healthy upstream"

    def _warn_unserved(self, now: dict[str, str]) -> None:
        """Log, count and keep (:attr:`unserved`: ``{cluster: why and what Envoy does}``) each cluster left
        without a healthy endpoint, once when it happens (a warning) and once when it ends."""
        now = {cluster: self._consequence(cluster, why) for cluster, why in now.items()}
        for cluster, why in now.items():
            if cluster not in self.unserved:
                log.warning("cluster %s has no healthy endpoint: %s", cluster, why)
                UNSERVED_TOTAL.labels(cluster).inc()
            UNSERVED.labels(cluster).set(1)
        for cluster in self.unserved.keys() - now.keys():
            log.info("cluster %s has a healthy endpoint again", cluster)
            UNSERVED.labels(cluster).set(0)
        self.unserved = now

    async def refresh(self) -> None:
        """A round now (after a reload); if the metrics source fails, republish from the last stats so a
        config change reaches Envoy even while Prometheus is down."""
        if not await self.run_round() and self.weights:
            await self.republish()

    def _fetch(self, instances: list[str]) -> tuple[dict, float]:
        """The source's answer and the monotonic time it came (blocking: runs in a worker thread)."""
        stats = self.source.fetch(instances)
        return stats, time.monotonic()

    async def run_round(self) -> bool:
        """One round; returns whether the metrics source answered. On a metrics failure the previous
        weights stay (before the first snapshot: see the class docstring)."""
        instances = [s.instance for s in self._specs]
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that arrives as
            # the fetch answers (CPython gh-86296), and the loop then never stops.
            async with asyncio.timeout(self.cfg.loop.timeout_s * 3):
                stats, fetched_at = await asyncio.to_thread(self._fetch, instances)
            ok = True
        except (MetricsUnavailable, TimeoutError) as err:
            ok = False
            stats = {}
            if self.metrics_ok is not False:
                why = str(err) or f"no answer within {self.cfg.loop.timeout_s * 3:g} s"
                log.error("metrics source failed: %s; keeping the last good weights", why)
        if ok and self.metrics_ok is False:
            log.info("metrics source is back")
        self.metrics_ok = ok
        METRICS_UP.set(1 if ok else 0)
        ROUNDS.labels("ok" if ok else "metrics_unavailable").inc()
        self.last_round_at = time.time()
        if not ok and self.weights:
            return False
        if not ok:
            waited = time.monotonic() - self._created
            if waited < self.cfg.loop.first_round_wait_s:
                return False
            log.error("no metrics after %.0f s: publishing the first snapshot with neutral weights", waited)
        else:
            self._stats = stats
            self.stats_at = fetched_at
            self._fit_staleness()
        await self._compute_and_publish(stats)
        return ok

    def _fit_staleness(self) -> None:
        """Raise the staleness threshold to :data:`~xds_server.config.model.STALE_INTERVALS` x the
        longest sample interval a source reports (Prometheus's scrape interval, read from its targets
        API), so sample ages cycling over one interval never flap health (issue 15 item 11). Logged
        once per change; ``engine.stale_after_s`` is used as configured when it is long enough."""
        intervals = getattr(self.source, "sample_intervals", dict)()
        configured = self.cfg.engine.stale_after_s
        name, interval = max(intervals.items(), key=lambda kv: kv[1], default=("", 0.0))
        wanted = max(configured, STALE_INTERVALS * interval)
        if wanted == self._params.stale_after_s:
            return
        if wanted > configured:
            log.warning("%s; using %g s", stale_message(configured, f"{name}'s sample interval", interval), wanted)
        else:
            log.info("engine.stale_after_s %g s fits every source's sample interval again", configured)
        self._params = replace(self._params, stale_after_s=wanted)
        if hasattr(self.source, "stale_after_s"):
            self.source.stale_after_s = wanted

    @property
    def stale_after_s(self) -> float:
        """The staleness threshold in use (s): ``engine.stale_after_s``, or longer (see :meth:`_fit_staleness`)."""
        return self._params.stale_after_s

    def _log_changes(self, weights: Verdicts) -> None:
        """One INFO line per changed weight or health, at most :data:`MAX_CHANGE_LINES` per round
        (then one line counting the rest: a 60 000-endpoint first round is not 60 000 lines)."""
        changed = weights.changed(self.weights)
        for w in map(weights.__getitem__, changed[:MAX_CHANGE_LINES].tolist()):
            scores = " ".join(f"{k}={v:.2f}" for k, v in w.scores.items() if v is not None)
            log.info("weight %s %s -> %d %s: %s%s", w.cluster, w.address, w.weight, w.health,
                     "; ".join(w.reasons), f" [{scores}]" if scores else "")
        if len(changed) > MAX_CHANGE_LINES:
            log.info("... and %d more weight or health changes this round (all in GET /api/v1/weights and the "
                     "history)", len(changed) - MAX_CHANGE_LINES)

    async def _publish(self, snap: Snapshot, weights: Verdicts) -> None:
        current = self.cache.latest()
        if current is not None and current.version == snap.version:
            return
        served = await self.cache.set(snap)
        for hook in self._hooks:
            done = hook(served, weights)
            if inspect.isawaitable(done):  # a hook that hands its work to a thread returns its future
                await done
        SNAPSHOTS.inc()
        self.ready.set()

    async def run(self) -> None:
        """Rounds forever, every ``loop.interval_s`` seconds."""
        while True:
            started = time.monotonic()
            try:
                await self.run_round()
            except Exception:  # a bug in one round must not stop the loop: last good snapshot stays
                log.exception("weight round failed; the last good snapshot keeps serving")
                ROUNDS.labels("error").inc()
            await asyncio.sleep(max(0.0, self.cfg.loop.interval_s - (time.monotonic() - started)))
