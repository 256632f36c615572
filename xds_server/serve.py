"""``inferlb serve``: the control plane, the picker and the admin API in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from aiohttp import web

from ext_proc.handler import PickerHandler
from ext_proc.sampler import DecisionSampler
from ext_proc.server import start_ext_proc_server
from ext_proc.transport.server import FastServer, start_fast_server
from ext_proc.view import ViewHolder

from .admin.app import make_admin_app
from .ads.cache import SnapshotCache
from .ads.server import AdsServicer, start_ads_server
from .config import Config, split_hostport
from .control import ControlPlane
from .history.recorder import HistoryRecorder
from .history.sqlite import open_store
from .metrics.push import start_push_server
from .metrics.sources import build_sources
from .picker_config import picker_settings, routing_table

log = logging.getLogger(__name__)


class InferLB:
    """One running inferlb: ADS server, ext_proc picker, admin API and the weight loop.

    After :meth:`start`, ``xds_port``, ``ext_proc_port``, ``admin_port`` (and ``push_port`` with the
    push source) hold the bound ports (the config may ask for port 0). ``recorder`` writes the weight
    history (``cfg.history``); ``sampler`` keeps a sample of the picker's decisions. Raises
    ``HistoryError`` when the history database cannot be opened.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sources = build_sources(cfg)
        self.cache = SnapshotCache(cfg.xds.debounce_s, cfg.xds.debounce_max_s)
        self.view = ViewHolder()
        self.sampler = DecisionSampler()
        self.picker = PickerHandler.from_settings(self.view, picker_settings(cfg), sampler=self.sampler)
        routing = routing_table(cfg)
        self.recorder = HistoryRecorder(open_store(cfg.history), cfg.history.keyframe_s, self._current_weights)
        self.control = ControlPlane(cfg, self.sources.combined, self.cache,
                                    [lambda snap, _weights: self.view.update(snap.assignments(), routing),
                                     self.recorder.record],
                                    lambda: cfg.envoy.ext_proc_address or
                                    f"{split_hostport(cfg.listen.ext_proc)[0]}:{self.ext_proc_port}")
        self.ads: AdsServicer | None = None
        self.ads_server: grpc.aio.Server | None = None
        self.ext_server: grpc.aio.Server | FastServer | None = None
        self._runner: web.AppRunner | None = None
        self._loop_task: asyncio.Task | None = None
        self._picker_task: asyncio.Task | None = None
        self._scrape_task: asyncio.Task | None = None
        self.push_server: grpc.aio.Server | None = None
        self.xds_port = self.ext_proc_port = self.admin_port = self.push_port = 0

    def _current_weights(self):
        snap = self.cache.snapshot
        return (snap.version if snap else None), self.control.weights

    async def start(self) -> None:
        """Bind every server and start the weight loop. Raises ``RuntimeError``/``OSError`` on bind failure."""
        self.ads_server, self.ads, self.xds_port = await start_ads_server(self.cache, self.cfg.listen.xds)
        if self.cfg.picker.transport == "fast":
            self.ext_server, self.ext_proc_port = await start_fast_server(self.picker, self.cfg.listen.ext_proc)
        else:
            self.ext_server, self.ext_proc_port = await start_ext_proc_server(self.picker, self.cfg.listen.ext_proc)
        self._runner = web.AppRunner(make_admin_app(self.control, self.ads, self.recorder.store, self.sampler),
                                     access_log=None)
        await self._runner.setup()
        host, port = split_hostport(self.cfg.listen.admin)
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.admin_port = self._runner.addresses[0][1]
        self.recorder.start()
        if self.sources.push is not None:
            self.push_server, self.push_port = await start_push_server(self.sources.push,
                                                                       self.cfg.metrics.push.listen)
        if self.sources.scrape is not None:
            self._scrape_task = asyncio.create_task(self.sources.scrape.run())
        self._loop_task = asyncio.create_task(self.control.run())
        self._picker_task = asyncio.create_task(self.picker.maintain())
        log.info("inferlb serving: xDS :%d, ext_proc :%d, admin :%d", self.xds_port, self.ext_proc_port,
                 self.admin_port)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop the loop and the servers (streams get ``grace_s`` seconds to finish)."""
        for task in (self._loop_task, self._picker_task, self._scrape_task):
            if task:
                task.cancel()
        for server in (self.ads_server, self.ext_server, self.push_server):
            if server is not None:
                await server.stop(grace=grace_s)
        if self._runner:
            await self._runner.cleanup()
        await asyncio.to_thread(self.recorder.close)


async def serve(cfg: Config, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    app = InferLB(cfg)
    await app.start()
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await app.stop()
