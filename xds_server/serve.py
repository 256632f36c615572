"""``inferlb serve``: the control plane, the picker and the admin API in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from ext_proc.server import start_ext_proc_server
from ext_proc.view import ViewHolder

from .admin.app import make_admin_app
from .ads.server import SnapshotCache, start_ads_server
from .config import Config, split_hostport
from .control import ControlPlane, routing_table
from .metrics.prometheus import PrometheusSource

log = logging.getLogger(__name__)


async def serve(cfg: Config, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGINT/SIGTERM): ADS, ext_proc and admin servers plus the weight loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    source = PrometheusSource(cfg.prometheus.url, cfg.prometheus.window_s, cfg.prometheus.timeout_s)
    cache = SnapshotCache()
    view = ViewHolder()
    routing = routing_table(cfg)
    cp = ControlPlane(cfg, source.fetch, source.name, cache,
                      [lambda snap: view.update(snap.assignments(), routing)])
    ads_server, ads, xds_port = await start_ads_server(cache, cfg.listen.xds)
    ext_server, ext_port = await start_ext_proc_server(view, cfg.listen.ext_proc)
    runner = web.AppRunner(make_admin_app(cp, ads), access_log=None)
    await runner.setup()
    host, port = split_hostport(cfg.listen.admin)
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("inferlb serving: xDS %s, ext_proc %s, admin %s", cfg.listen.xds, cfg.listen.ext_proc,
             cfg.listen.admin)
    loop_task = asyncio.create_task(cp.run())
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        loop_task.cancel()
        await ads_server.stop(grace=1.0)
        await ext_server.stop(grace=1.0)
        await runner.cleanup()
