"""``inferlb serve``: the control plane, the picker and the admin API in one process.

Lifecycle:
- start: bind the ADS, ext_proc and admin servers, then run weight rounds. ``/readyz`` turns 200
  once the first snapshot is published (after the first metrics round, see ``ControlPlane``).
- reload (SIGHUP, the config file changing, or ``POST /api/v1/reload``): a valid new config
  rebuilds the control plane's inputs and pushes at once; an invalid one is refused with a clear
  error, logged and counted, and the last good config keeps serving. ``listen`` and ``tls`` need a
  restart (they are what the sockets were bound with).
- stop (SIGTERM/SIGINT): ``/readyz`` turns 503, the gRPC servers stop accepting new streams,
  open streams get ``grace_s`` seconds to finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import grpc
from aiohttp import web
from prometheus_client import Counter, Gauge
from pydantic import ValidationError

from ext_proc.server import start_ext_proc_server
from ext_proc.view import ViewHolder

from .admin.app import WriteAuth, make_admin_app
from .ads.server import AdsServicer, SnapshotCache, start_ads_server
from .config import Config, ConfigError, load_config, split_hostport
from .control import ControlPlane, routing_table
from .discovery.kubernetes import Discovered, KubernetesWatcher, compose_config
from .metrics.prometheus import PrometheusSource
from .tls import server_credentials

log = logging.getLogger(__name__)

RELOADS = Counter("inferlb_config_reloads_total", "Config reloads, by outcome", ["outcome"])
RELOAD_OK = Gauge("inferlb_config_last_reload_ok", "1 when the last config reload was applied, 0 when refused")
TOKEN_ENV = "INFERLB_ADMIN_TOKEN"


def _source(cfg: Config) -> PrometheusSource:
    return PrometheusSource(cfg.prometheus.url, cfg.prometheus.window_s, cfg.prometheus.timeout_s)


class InferLB:
    """One running inferlb: ADS server, ext_proc picker, admin API and the weight loop.

    After :meth:`start`, ``xds_port``, ``ext_proc_port`` and ``admin_port`` hold the bound ports
    (the config may ask for port 0). ``config_path``: the file :meth:`reload` reads again.
    """

    def __init__(self, cfg: Config, config_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.base_cfg = cfg   # the file's config; discovered services are added to it
        self.discovered: Discovered | None = None
        self._discovered_once = asyncio.Event()
        self._watcher: KubernetesWatcher | None = None
        self.config_path = config_path
        source = _source(cfg)
        self.cache = SnapshotCache()
        self.view = ViewHolder()
        self.routing = routing_table(cfg)
        self.control = ControlPlane(cfg, source.fetch, source.name, self.cache,
                                    [lambda snap, _weights: self.view.update(snap.assignments(), self.routing)],
                                    lambda: self.cfg.envoy.ext_proc_address or
                                    f"{split_hostport(self.cfg.listen.ext_proc)[0]}:{self.ext_proc_port}")
        self.ads: AdsServicer | None = None
        self.ads_server: grpc.aio.Server | None = None
        self.ext_server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self._reload_lock = asyncio.Lock()
        self.stopping = False
        self.last_reload_error: str | None = None
        self.xds_port = self.ext_proc_port = self.admin_port = 0

    async def start(self) -> None:
        """Bind every server and start the weight loop.

        Raises ``RuntimeError``/``OSError`` on bind failure, ``ConfigError`` on unreadable TLS files.
        """
        creds = server_credentials(self.cfg.tls) if self.cfg.tls else None
        self.ads_server, self.ads, self.xds_port = await start_ads_server(
            self.cache, self.cfg.listen.xds, max_streams=self.cfg.listen.max_xds_streams, credentials=creds)
        self.ext_server, self.ext_proc_port = await start_ext_proc_server(
            self.view, self.cfg.listen.ext_proc, credentials=creds)
        host, port = split_hostport(self.cfg.listen.admin)
        auth = WriteAuth(self.cfg.admin.token or os.environ.get(TOKEN_ENV) or None, host)
        app = make_admin_app(self.control, self.ads, auth=auth, reload=self.reload,
                             is_ready=lambda: self.control.ready.is_set() and not self.stopping)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.admin_port = self._runner.addresses[0][1]
        self._loop_task = asyncio.create_task(self._run_loop())
        log.info("inferlb serving: xDS :%d, ext_proc :%d, admin :%d%s", self.xds_port, self.ext_proc_port,
                 self.admin_port, " (TLS)" if creds else "")

    async def _run_loop(self) -> None:
        """The weight loop; with Kubernetes discovery, only once the first list is in (so nothing
        partial is ever pushed)."""
        spec = self.cfg.discovery.kubernetes
        if spec is not None:
            loop = asyncio.get_running_loop()
            self._watcher = KubernetesWatcher(
                spec, lambda d: loop.call_soon_threadsafe(lambda: loop.create_task(self.on_discovered(d))))
            self._watcher.start()
            await self._discovered_once.wait()
        await self.control.run()

    async def on_discovered(self, discovered: Discovered) -> None:
        """A new discovered endpoint set: compose it into the config and apply it (a set that does
        not make a valid config is logged and skipped; the last good one keeps serving)."""
        try:
            new = compose_config(self.base_cfg, discovered)
        except ValidationError as err:
            self._refused("invalid-discovery", f"discovered endpoints refused: {err}")
            return
        self.discovered = discovered
        await self.apply_config(new)
        self._discovered_once.set()

    async def reload(self) -> tuple[bool, str]:
        """Read ``config_path`` again and apply it. Returns ``(applied, message)``; never raises."""
        if self.config_path is None:
            return False, "no config file to reload (started from an in-memory config)"
        try:
            base = load_config(self.config_path)
            new = compose_config(base, self.discovered) if self.discovered is not None else base
        except ConfigError as err:
            return self._refused("invalid", f"config reload refused, the last good config keeps serving:\n{err}")
        except ValidationError as err:
            return self._refused("invalid", f"config reload refused (with the discovered endpoints): {err}")
        if base.discovery != self.base_cfg.discovery:
            return self._refused("refused", "config reload refused: discovery cannot change without a restart")
        applied, message = await self.apply_config(new)
        if applied:
            self.base_cfg = base
        return applied, message

    async def apply_config(self, new: Config) -> tuple[bool, str]:
        """Apply a validated config: rebuild the control plane's inputs and push at once.

        Refused (``(False, why)``) when ``listen`` or ``tls`` differ: the sockets are bound with them.
        """
        async with self._reload_lock:
            fixed = [name for name in ("listen", "tls") if getattr(new, name) != getattr(self.cfg, name)]
            if fixed:
                return self._refused("refused", f"config reload refused: {', '.join(fixed)} cannot change "
                                                "without a restart; the last good config keeps serving")
            if new == self.cfg:
                RELOADS.labels("unchanged").inc()
                return True, "config unchanged"
            source = _source(new) if new.prometheus != self.cfg.prometheus else None
            self.cfg = new
            self.routing = routing_table(new)
            self.control.reconfigure(new, source.fetch if source else None, source.name if source else None)
            await self.control.refresh()
            RELOADS.labels("ok").inc()
            RELOAD_OK.set(1)
            self.last_reload_error = None
            version = self.cache.snapshot.version if self.cache.snapshot else None
            log.info("config reloaded from %s; snapshot %s", self.config_path, version)
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
        if self._loop_task:
            self._loop_task.cancel()
        if self._watcher is not None:
            self._watcher.stop()
        servers = [s for s in (self.ads_server, self.ext_server) if s is not None]
        await asyncio.gather(*(s.stop(grace=grace_s) for s in servers))
        if self._runner:
            await self._runner.cleanup()


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
    await app.start()
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
