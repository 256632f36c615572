"""``inferlb serve``: the control plane, the picker and the admin API in one process.

Lifecycle:
- start: bind the ADS, ext_proc and admin servers, then run weight rounds. ``/readyz`` turns 200
  once the first snapshot is published (after the first metrics round, see ``ControlPlane``).
- reload (SIGHUP, the config file changing, or ``POST /api/v1/reload``): a valid new config
  rebuilds the control plane's inputs and pushes at once; an invalid one is refused with a clear
  error, logged and counted, and the last good config keeps serving. ``listen``, ``tls``,
  ``picker``, ``metrics``, ``prometheus`` and ``history`` need a restart (the sockets, the picker,
  the metrics sources and the history store were built with them).
- stop (SIGTERM/SIGINT): ``/readyz`` turns 503, the gRPC servers stop accepting new streams,
  open streams get ``grace_s`` seconds to finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from aiohttp import web
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from ext_proc import transport
from ext_proc.handler import PickerHandler
from ext_proc.inflight import MemorySamples
from ext_proc.kv_events import KvEventsUnavailable, check_feed, start_feed
from ext_proc.load_client import run_load_view
from ext_proc.sampler import DecisionSampler
from ext_proc.shared_load import SharedLoad
from ext_proc.transport.base import Server, TlsFiles, ssl_context
from ext_proc.view import EndpointView, ViewHolder
from inferlb.listeners import binding
from inferlb.picker_config import CONFIG_CHECKS, picker_metadata, picker_settings, routing_table
from xds_server.admin.app import WriteAuth, make_admin_app
from xds_server.ads.cache import SnapshotCache
from xds_server.ads.server import AdsServicer, start_ads_server
from xds_server.config import Config, ConfigError, TlsConfig, load_config, split_hostport
from xds_server.config.model import TOKEN_MIN_LENGTH
from xds_server.control import ControlPlane
from xds_server.discovery import etcd as etcd_discovery
from xds_server.discovery.etcd import EtcdWatcher
from xds_server.discovery.kubernetes import Discovered, KubernetesWatcher, compose_config, require_client
from xds_server.engine.types import EndpointSpec, EndpointWeight
from xds_server.engine.verdicts import Verdicts
from xds_server.history.recorder import HistoryRecorder
from xds_server.history.sqlite import check_path, open_store
from xds_server.history.types import HistoryError
from xds_server.loadview.service import add_load_view_servicer
from xds_server.loadview.table import LoadTable
from xds_server.metrics.build import build_sources
from xds_server.metrics.sources.envoy import ClientView
from xds_server.metrics.sources.push import start_push_server
from xds_server.metrics.stats import STAT_FIELDS
from xds_server.release import trim_heap
from xds_server.tls import server_credentials

log = logging.getLogger(__name__)

#: Rounds between two looks at the frozen objects, each maybe a full cyclic-GC pass (``InferLB._round_heap``).
UNFREEZE_EVERY = 60
#: A full pass is due only once the frozen objects grew by this factor since the last one: CPython's own
#: rule for its full collections (a full pass once the objects that survived since the last one reach a
#: quarter of the long-lived ones: ``long_lived_pending > long_lived_total / 4``, Modules/gcmodule.c,
#: 3.11), here over the objects a round's ``gc.freeze`` kept.
FULL_PASS_GROWTH = 1.25


def full_pass_due(frozen: int, frozen_after_last: int) -> bool:
    """Whether the round context hands the frozen objects back to the collector for a full pass (pure):
    only once the frozen set (``frozen``, ``gc.get_freeze_count()``) grew to :data:`FULL_PASS_GROWTH`
    times what the last pass left (``frozen_after_last``). A steady process, whose rounds leave the
    same objects alive, skips the pass: its cost is a walk over the whole heap with the event loop and
    the picker stalled (``inferlb bench quality``'s chat_resend: 52-58 ms of CPU over 90 000-92 000
    objects, 15 of them garbage, 190-240 ms of wall time on a loaded machine).

    >>> full_pass_due(124_999, 100_000), full_pass_due(125_000, 100_000)
    (False, True)
    """
    return frozen >= FULL_PASS_GROWTH * frozen_after_last

RELOADS = Counter("inferlb_config_reloads_total", "Config reloads, by outcome", ["outcome"])
RELOAD_OK = Gauge("inferlb_config_last_reload_ok",
                  "1 when the config in use is the file's last version (loaded at start, or the last reload "
                  "applied or found nothing to change), 0 when the last reload was refused")
TOKEN_ENV = "INFERLB_ADMIN_TOKEN"
#: Config sections a reload cannot change: what the sockets, picker, sources and store were built with.
RESTART_ONLY = ("listen", "tls", "picker", "metrics", "prometheus", "history")


def require_runtime(cfg: Config) -> None:
    """Refuse a config whose parts cannot run in this installation, before anything binds: the
    ``kubernetes`` package for ``discovery.kubernetes``; with ``picker.prefix_source: kv_events``,
    ``pyzmq`` and ``msgpack`` and a loadable ``picker.kv_events.tokenizer``; a ``history.path`` this
    user could not create or write (:func:`xds_server.history.sqlite.check_path`). ``inferlb validate``
    and ``inferlb serve`` both call it, so they refuse the same configs.

    Raises:
        ConfigError: naming what is missing and the setting that needs it.
    """
    require_client(cfg)
    try:
        check_path(cfg.history)
    except HistoryError as err:
        raise ConfigError(str(err)) from None
    if cfg.picker.prefix_source == "kv_events":
        try:
            check_feed(cfg.picker.kv_events.tokenizer, cfg.picker.kv_events.keys)
        except KvEventsUnavailable as err:
            raise ConfigError(str(err)) from None


def admin_token(cfg: Config) -> str | None:
    """The admin API's bearer token: ``admin.token``, else ``INFERLB_ADMIN_TOKEN`` (empty = unset).

    Raises:
        ConfigError: the environment variable is in use and shorter than ``admin.token`` may be.
    """
    if cfg.admin.token:
        return cfg.admin.token
    token = os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < TOKEN_MIN_LENGTH:
        raise ConfigError(f"{TOKEN_ENV} must be at least {TOKEN_MIN_LENGTH} characters, like admin.token "
                          f"(it has {len(token)})")
    return token


def picker_tls(tls: TlsConfig) -> TlsFiles:
    """The picker's TLS files from the ``tls`` section, checked now (so a bad file is a config error).

    Raises:
        ConfigError: a file can't be read or is not a certificate, key or CA bundle.
    """
    files = TlsFiles(tls.cert, tls.key, tls.ca, tls.require_client_cert)
    try:
        ssl_context(files)
    except (OSError, ssl.SSLError, ValueError) as err:
        raise ConfigError(f"tls: cannot load {tls.cert}, {tls.key} or {tls.ca}: {err}") from None
    return files


_FREE, _USED, _AGE, _IN_FLIGHT = (STAT_FIELDS.index(f) for f in ("gpu_mem_free_mib", "gpu_mem_used_mib",
                                                                   "sample_age_s", "in_flight"))
#: Endpoints per C-level dict update in :func:`memory_samples` (one update of 60 000 held the GIL, which
#: the event loop shares, for tens of ms: caught by a faulthandler watchdog at 35 ms).
PIECE = 4096


def memory_samples(weights: Sequence[EndpointWeight], spec: Callable[[str, str], EndpointSpec | None], now: float
                   ) -> dict[str, tuple[float, float]]:
    """``{"HOST:PORT": (free GPU memory MiB, sampled at)}`` from one round's weights (pure; read from
    their columns: :class:`~xds_server.engine.verdicts.Verdicts`).

    Free memory is ``gpu_mem_free_mib``, else the endpoint's GPU memory minus ``gpu_mem_used_mib``;
    an endpoint with neither, or with no sample age, is left out (unknown: the picker admits).
    ``sampled at`` = ``now`` - the sample's age (monotonic s).
    """
    out: dict[str, tuple[float, float]] = {}
    for part in Verdicts.of(weights).parts:
        free, used, age = part.stats[:, _FREE].copy(), part.stats[:, _USED], part.stats[:, _AGE]
        for i in np.flatnonzero(np.isnan(free) & ~np.isnan(used) & ~np.isnan(age)).tolist():
            s = spec(part.cluster, part.addresses[i])
            free[i] = np.nan if s is None else max(0.0, s.memory_mib - used[i])
        at = np.flatnonzero(~np.isnan(free) & ~np.isnan(age))
        addresses, taken = np.array(part.addresses, dtype=object)[at].tolist(), (now - age[at]).tolist()
        free_now = free[at].tolist()
        for start in range(0, len(at), PIECE):  # one C-level update per piece: the GIL changes hands between
            end = start + PIECE
            out.update(zip(addresses[start:end], zip(free_now[start:end], taken[start:end], strict=True),
                           strict=True))
    return out


def held_counts(weights: Sequence[EndpointWeight], endpoints: Container[str]) -> dict[str, float]:
    """``{"HOST:PORT": requests the backend held at its newest sample (running + waiting)}`` of the
    ``endpoints`` whose count is known (pure; the ``in_flight`` column of the round's weights)."""
    out: dict[str, float] = {}
    for part in Verdicts.of(weights).parts:
        held = part.stats[:, _IN_FLIGHT]
        for i in np.flatnonzero(held >= 0).tolist():
            if part.addresses[i] in endpoints:
                out[part.addresses[i]] = float(held[i])
    return out


def largest_memory(specs: Iterable[EndpointSpec]) -> dict[str, float]:
    """``{cluster: the largest whole GPU memory of its endpoints, MiB}`` (pure)."""
    out: dict[str, float] = {}
    for s in specs:
        if s.memory_mib > out.get(s.cluster, 0.0):
            out[s.cluster] = s.memory_mib
    return out


def fleet_in_flight(fleet: Mapping[str, float], pickers: int, own: Mapping[str, float],
                    own_in_view: bool) -> Mapping[str, float]:
    """Requests in flight per cluster for the autoscaling signal (pure): the shared load view's sum
    over its ``pickers`` reporting pickers (``fleet``: ``{cluster: requests}``) while any reports,
    plus the in-process picker's ``own`` when it is not one of them (with TLS it does not report to
    the view: its client would need a certificate of its own); no picker reporting: ``own`` alone.

    >>> fleet_in_flight({"c": 3.0}, 1, {"c": 2}, False), fleet_in_flight({"c": 3.0}, 2, {"c": 2}, True)
    ({'c': 5.0}, {'c': 3.0})
    >>> fleet_in_flight({}, 0, {"c": 2}, True)
    {'c': 2}
    """
    if not pickers:
        return own
    if own_in_view:
        return fleet
    out = dict(fleet)
    for cluster, n in own.items():
        out[cluster] = out.get(cluster, 0.0) + n
    return out

class InferLB:
    """One running inferlb: ADS server, ext_proc picker, admin API and the weight loop.

    After :meth:`start`, ``xds_port``, ``ext_proc_port``, ``admin_port`` (and ``push_port`` with the
    push source) hold the bound ports (the config may ask for port 0). ``config_path``: the file
    :meth:`reload` reads again. ``recorder`` writes the weight history (``cfg.history``);
    ``sampler`` keeps a sample of the picker's decisions. Raises ``HistoryError`` when the history
    database cannot be opened.
    """

    def __init__(self, cfg: Config, config_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.base_cfg = cfg   # the file's config; discovered services are added to it
        self.discovered: Discovered | None = None         # from Kubernetes
        self.discovered_etcd: Discovered | None = None    # from etcd registrations
        self._discovered_once = {name: asyncio.Event() for name in ("kubernetes", "etcd")
                                 if getattr(cfg.discovery, name) is not None}
        self._watcher: KubernetesWatcher | None = None
        self.etcd_watcher: EtcdWatcher | None = None
        self._etcd_task: asyncio.Task | None = None
        self.config_path = config_path
        self.client_view = ClientView(window_s=cfg.prometheus.window_s)
        self.sources = build_sources(cfg, self.client_view)
        self.cache = SnapshotCache(cfg.xds.debounce_s, cfg.xds.debounce_max_s)
        self.view = ViewHolder(EndpointView.empty(routing_table(cfg)))   # the picker's protocol from the start
        self._view_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picker-view")
        self._rounds_frozen = 0
        self._frozen_after_pass: int | None = None  # objects frozen after the last full GC pass (or first count)
        self._largest: tuple[Sequence[EndpointSpec] | None, dict[str, float]] = (None, {})
        self.sampler = DecisionSampler()
        self.picker = PickerHandler.from_settings(self.view, picker_settings(cfg), sampler=self.sampler,
                                                  completions=self.client_view)
        self.routing = routing_table(cfg)
        self.recorder = HistoryRecorder(open_store(cfg.history), cfg.history.keyframe_s, self._current_weights)
        self.control = ControlPlane(cfg, self.sources.combined, self.cache,
                                    [self._update_picker_view, self.recorder.record, self._trim_heap],
                                    lambda: self.cfg.envoy.ext_proc_address or
                                    f"{split_hostport(self.cfg.listen.ext_proc)[0]}:{self.ext_proc_port}",
                                    picker_metadata=picker_metadata, on_round=[self._feed_picker],
                                    round_context=self._round_heap)
        self.ads: AdsServicer | None = None
        self.ads_server: grpc.aio.Server | None = None
        self.ext_server: Server | None = None
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self._picker_task: asyncio.Task | None = None
        self._share_task: asyncio.Task | None = None
        self._kv_task: asyncio.Task | None = None
        self.load_view = LoadTable(cfg.picker.shared_view_expiry_s)
        self._scrape_task: asyncio.Task | None = None
        self.push_server: grpc.aio.Server | None = None
        self._reload_lock = asyncio.Lock()
        self.stopping = False
        self.last_reload_error: str | None = None
        self.xds_port = self.ext_proc_port = self.admin_port = self.push_port = 0

    async def _feed_picker(self, weights: Verdicts) -> None:
        """Each round: the free GPU memory of every endpoint, with when it was sampled, to the picker
        (its memory admission subtracts what it sent since), and each one's whole GPU memory (a
        request needing more than every endpoint has is refused); with ``picker.memory_count_in_sample``
        also the requests each backend held in that sample (:func:`held_counts`; the load view sends each
        standalone picker its share of them: ``MemorySample.held``). Read from the weights in a worker
        thread (30 ms at 60 000 endpoints), handed over on the loop. Sample ages count from the fetch,
        not from now: the round's computation in between would make every sample look younger."""
        at, specs = self.control.stats_at, self.control.specs

        def read() -> tuple:
            samples = memory_samples(weights, self.control.spec, time.monotonic() if at is None else at)
            if self._largest[0] is not specs:  # the config's: computed again when it changes
                self._largest = (specs, largest_memory(specs))
            held = held_counts(weights, samples) if self.cfg.picker.memory_count_in_sample else None
            return samples, MemorySamples.of(samples, held), self._largest[1], held

        samples, split, largest, held = await asyncio.to_thread(read)
        self.picker.control.set_samples(split)  # on the loop the picker runs on: O(requests in flight)
        self.picker.control.set_largest_memory(largest)
        await asyncio.sleep(0)  # the loop runs its other callbacks between the two: not one ~30 ms step
        self.load_view.set_memory(samples, held)  # and, with the load view, to every standalone picker

    def _update_picker_view(self, snap, _weights) -> asyncio.Future:
        """ControlPlane hook: rebuild the picker's endpoint view (its consistent-hash rings) from the
        snapshot in a worker thread (one at a time, in order), so a 60 000-endpoint view does not
        freeze the event loop; the round waits for it. The swap of the current view is atomic."""
        routing = self.routing
        return asyncio.get_running_loop().run_in_executor(
            self._view_pool, lambda: self.view.update(snap.assignments(), routing))

    def _trim_heap(self, _snap, _weights) -> asyncio.Future:
        """ControlPlane hook, after the picker's view: the C heap's free pages go back to the OS
        (:func:`xds_server.release.trim_heap`, ~10 ms at 60 000 endpoints) in the view's worker
        thread, so a round's freed buffers do not stay in the RSS."""
        return asyncio.get_running_loop().run_in_executor(self._view_pool, trim_heap)

    @contextlib.contextmanager
    def _round_heap(self) -> Iterator[None]:
        """ControlPlane round context: no automatic cyclic GC during a round, and what is alive after
        it (config, engine state, the picker's rings, the snapshot) moved out of the collector's
        generations (``gc.freeze``). A collection walks every tracked object it covers with the GIL
        held, so it stalls the event loop even when the round runs in a worker thread: at 60 000
        endpoints a round's ~1 million new objects set off 6 full passes of 30-70 ms each (and 0.3 s
        of CPU) inside the engine, and a full pass over the whole heap takes ~0.4 s
        (bench/scale_bench.py). Frozen objects are still freed by reference counting when the next
        round replaces them; reference cycles among them are garbage only a full pass finds. Every
        :data:`UNFREEZE_EVERY` rounds the frozen objects are counted (``gc.get_freeze_count`` walks
        them all, so not every round), and once they may have piled up (:func:`full_pass_due`: a
        quarter more than the last pass left; the first count sets that baseline) everything is
        handed back to the collector for one full pass."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            self._rounds_frozen += 1
            gc.freeze()
            if self._rounds_frozen >= UNFREEZE_EVERY:
                self._rounds_frozen = 0
                frozen = gc.get_freeze_count()
                if self._frozen_after_pass is not None and full_pass_due(frozen, self._frozen_after_pass):
                    gc.unfreeze()
                    gc.collect()
                    gc.freeze()
                    frozen = gc.get_freeze_count()
                    self._frozen_after_pass = None
                if self._frozen_after_pass is None:
                    self._frozen_after_pass = frozen
            if enabled:
                gc.enable()

    def _live_load(self) -> tuple[Mapping[str, float], dict[str, int]]:
        """``({cluster: requests in flight}, {cluster: requests waiting in the picker's queue})`` for the
        autoscaling signal (read on the event loop the picker and the load view run on). In flight:
        the sum over every picker in the shared load view while any reports (each gateway's Envoy
        sends a share of the traffic), else the in-process picker's own count. Waiting: the
        in-process picker's queue (the load reports carry no queue)."""
        admission = self.picker.control.admission
        queued = {} if admission is None else {c: admission.queued(c) for c in self.view.current.clusters}
        fleet = self.load_view.totals(time.monotonic())
        own_in_view = self._share_task is not None
        return fleet_in_flight({c: load.in_flight for c, load in fleet.clusters.items()}, fleet.pickers,
                               self.picker.control.inflight.clusters, own_in_view), queued

    def _current_weights(self):
        snap = self.cache.snapshot
        return (snap.version if snap else None), self.control.weights

    async def start(self) -> None:
        """Bind every server and start the weight loop.

        Raises :class:`BindError` when a listener cannot bind its address, ``ConfigError`` on
        unreadable TLS files, a short ``INFERLB_ADMIN_TOKEN``, ``picker.prefix_source: kv_events``
        without pyzmq or msgpack, or ``discovery.kubernetes`` and no
        ``kubernetes`` package. What started before the error is left running: :meth:`stop` ends it.
        """
        require_runtime(self.cfg)
        token = admin_token(self.cfg)
        tls = self.cfg.tls
        creds = server_credentials(tls) if tls else None
        listen = self.cfg.listen
        with binding("listen.xds", listen.xds):
            self.ads_server, self.ads, self.xds_port = await start_ads_server(
                self.cache, listen.xds, max_streams=listen.max_xds_streams, credentials=creds,
                services=[add_load_view_servicer(self.load_view)])
        files = picker_tls(tls) if tls else None
        with binding("listen.ext_proc", listen.ext_proc):
            self.ext_server, self.ext_proc_port = await transport.start(
                self.cfg.picker.transport, self.picker, listen.ext_proc, tls=files)
        host, port = split_hostport(listen.admin)
        auth = WriteAuth(token, host)
        app = make_admin_app(self.control, self.ads, self.recorder.store, self.sampler, auth=auth,
                             reload=self.reload, is_ready=lambda: self.control.ready.is_set() and not self.stopping,
                             cost_model=self.picker.control.costs, load_view=self.load_view,
                             live_load=self._live_load)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        with binding("listen.admin", listen.admin):
            await web.TCPSite(self._runner, host, port).start()
        self.admin_port = self._runner.addresses[0][1]
        self.recorder.start()
        if self.sources.push is not None:
            with binding("metrics.push.listen", self.cfg.metrics.push.listen):
                self.push_server, self.push_port = await start_push_server(self.sources.push,
                                                                           self.cfg.metrics.push.listen)
        if self.sources.scrape is not None:
            self._scrape_task = asyncio.create_task(self.sources.scrape.run())
        self._loop_task = asyncio.create_task(self._run_loop())
        self._picker_task = asyncio.create_task(self.picker.maintain())
        self._kv_task = start_feed(self.picker.control.prefixes, self.view, picker_settings(self.cfg))
        if not tls:  # the in-process picker is one of the gateways too (its memory samples come directly)
            p = self.cfg.picker
            shared = self.picker.control.share_load() if p.shared_view else SharedLoad(self.picker.control.inflight)
            self._share_task = asyncio.create_task(run_load_view(
                f"{_loopback(split_hostport(self.cfg.listen.xds)[0])}:{self.xds_port}",
                f"inferlb-serve-{socket.gethostname()}-{os.getpid()}", shared,
                p.shared_view_interval_s, p.shared_view_expiry_s, on_view=self.picker.control.others_changed))
        RELOAD_OK.set(1)  # the config in use is the file's, loaded and valid
        log.info("inferlb serving: xDS :%d, ext_proc :%d, admin :%d%s", self.xds_port, self.ext_proc_port,
                 self.admin_port, " (TLS)" if creds else "")

    async def _run_loop(self) -> None:
        """The weight loop; with Kubernetes or etcd discovery, only once the first list of each is
        in (so nothing partial is ever pushed)."""
        spec = self.cfg.discovery.kubernetes
        if spec is not None:
            loop = asyncio.get_running_loop()
            self._watcher = KubernetesWatcher(
                spec, lambda d: loop.call_soon_threadsafe(lambda: loop.create_task(self.on_discovered(d))))
            self._watcher.start()
        etcd = self.cfg.discovery.etcd
        if etcd is not None:
            self.etcd_watcher = EtcdWatcher(etcd, self.cfg.gpu_classes,
                                            lambda d: self.on_discovered(d, "etcd"), self.sources.status)
            self._etcd_task = asyncio.create_task(self.etcd_watcher.run())
        for once in self._discovered_once.values():
            await once.wait()
        await self.control.run()

    def _compose(self, base: Config, kubernetes: Discovered | None, etcd: Discovered | None) -> Config:
        """``base`` with the services of each discovery source. Raises pydantic.ValidationError."""
        cfg = compose_config(base, kubernetes) if kubernetes is not None else base
        return etcd_discovery.compose_config(cfg, etcd) if etcd is not None else cfg

    async def on_discovered(self, discovered: Discovered, source: str = "kubernetes") -> None:
        """A new discovered endpoint set from ``source`` (``kubernetes`` or ``etcd``): compose it into
        the config and apply it (a set that does not make a valid config is logged and skipped; the
        last good one keeps serving)."""
        k8s = discovered if source == "kubernetes" else self.discovered
        etcd = discovered if source == "etcd" else self.discovered_etcd
        try:
            new = self._compose(self.base_cfg, k8s, etcd)
        except ValidationError as err:
            self._refused("invalid-discovery", f"discovered endpoints ({source}) refused: {err}")
            return
        self.discovered, self.discovered_etcd = k8s, etcd
        await self.apply_config(new, f"discovered endpoints ({source})")
        self._discovered_once[source].set()

    async def reload(self) -> tuple[bool, str]:
        """Read ``config_path`` again and apply it. Returns ``(applied, message)``; never raises."""
        if self.config_path is None:
            return False, "no config file to reload (started from an in-memory config)"
        try:
            base = load_config(self.config_path, CONFIG_CHECKS)
            new = self._compose(base, self.discovered, self.discovered_etcd)
        except ConfigError as err:
            return self._refused("invalid", f"config reload refused, the last good config keeps serving:\n{err}")
        except ValidationError as err:
            return self._refused("invalid", f"config reload refused (with the discovered endpoints): {err}")
        except Exception as err:  # a loader bug must not end the file watcher or answer 500: refuse, with the trace
            log.exception("config reload failed")
            return self._refused("invalid", f"config reload refused, the last good config keeps serving: {err!r}")
        if base.discovery != self.base_cfg.discovery:
            return self._refused("refused", "config reload refused: discovery cannot change without a restart")
        try:
            applied, message = await self.apply_config(new)
        except Exception as err:  # as above: the watcher and the admin API get a refusal, the trace goes to the log
            log.exception("config reload failed")
            return self._refused("invalid", f"config reload refused, the last good config keeps serving: {err!r}")
        if applied:
            self.base_cfg = base
        return applied, message

    async def apply_config(self, new: Config, what: str | None = None) -> tuple[bool, str]:
        """Apply a validated config: rebuild the control plane's inputs and push at once. ``what``:
        where the change came from, for the log (default: the config file).

        Refused (``(False, why)``) when a :data:`RESTART_ONLY` section differs.
        """
        async with self._reload_lock:
            fixed = [name for name in RESTART_ONLY if getattr(new, name) != getattr(self.cfg, name)]
            if fixed:
                return self._refused("refused", f"config reload refused: {', '.join(fixed)} cannot change "
                                                "without a restart; the last good config keeps serving")
            if new == self.cfg:
                RELOADS.labels("unchanged").inc()
                RELOAD_OK.set(1)
                self.last_reload_error = None
                return True, "config unchanged"
            try:
                routing = routing_table(new)  # before anything changes: a config it refuses leaves the last good one
            except ValueError as err:
                return self._refused("invalid", f"config reload refused: {err}; the last good config keeps serving")
            self.cfg = new
            self.routing = routing
            self.control.reconfigure(new)
            await self.control.refresh()
            RELOADS.labels("ok").inc()
            RELOAD_OK.set(1)
            self.last_reload_error = None
            latest = self.cache.latest()  # the new one, published or still in its debounce window
            version = latest.version if latest else None
            log.info("%s applied; snapshot %s", what or f"config from {self.config_path}", version)
            return True, f"config reloaded; snapshot {version}"

    def _refused(self, outcome: str, message: str) -> tuple[bool, str]:
        RELOADS.labels(outcome).inc()
        RELOAD_OK.set(0)
        self.last_reload_error = message
        log.error("%s", message)
        return False, message

    async def stop(self, grace_s: float = 1.0) -> None:
        """Graceful stop: not ready, no new streams, open streams get ``grace_s`` s, then all closed."""
        self.stopping = True
        for task in (self._loop_task, self._picker_task, self._scrape_task, self._etcd_task, self._share_task,
                     self._kv_task):
            if task:
                task.cancel()
        if self._watcher is not None:
            self._watcher.stop()
        servers = [s for s in (self.ads_server, self.ext_server, self.push_server) if s is not None]
        await asyncio.gather(*(s.stop(grace=grace_s) for s in servers))
        if self._runner:
            await self._runner.cleanup()
        await asyncio.to_thread(self.recorder.close)
        self._view_pool.shutdown(wait=False)


def _loopback(host: str) -> str:
    """Where this process reaches its own server bound to ``host`` (a wildcard: the loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)


async def _watch_file(path: Path, interval_s: float, on_change) -> None:
    """Call ``on_change()`` when ``path``'s (mtime, size, inode) changes; polls every ``interval_s``."""
    def stamp():
        with contextlib.suppress(OSError):
            st = path.stat()
            return st.st_mtime_ns, st.st_size, st.st_ino
        return None

    last = stamp()
    while True:
        await asyncio.sleep(interval_s)
        now = stamp()
        if now != last and now is not None:
            last = now
            log.info("config file %s changed; reloading", path)
            await on_change()


async def serve(cfg: Config, stop: asyncio.Event | None = None, *, config_path: str | Path | None = None,
                watch_interval_s: float = 0.0, grace_s: float = 5.0) -> None:
    """Run until ``stop`` is set or SIGINT/SIGTERM arrives; SIGHUP (and, with ``watch_interval_s`` > 0,
    a change of ``config_path``) reloads the config."""
    stop = stop or asyncio.Event()
    app = InferLB(cfg, config_path)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def reload_soon() -> None:
        task = loop.create_task(app.reload())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGHUP, reload_soon)
    try:
        await app.start()
    except BaseException:
        await app.stop(0)   # what did start (a gRPC server left to the GC logs "Event loop is closed")
        raise
    watcher = (asyncio.create_task(_watch_file(Path(config_path), watch_interval_s, app.reload))
               if config_path and watch_interval_s > 0 else None)
    try:
        await stop.wait()
    finally:
        log.info("shutting down: not ready, no new streams, %.1f s for open ones", grace_s)
        if watcher:
            watcher.cancel()
        await app.stop(grace_s)
        log.info("stopped")
