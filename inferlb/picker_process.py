"""``inferlb ext-proc --xds HOST:PORT``: the picker alone, fed over ADS by the control plane, and its workers.

The picker subscribes to CDS and EDS (:mod:`ext_proc.xds_client`), reads its routing table and
settings from the metadata of the picker's cluster (:mod:`ext_proc.settings`), and starts
serving once it has them (until then Envoy fails open). It reports its live load to the same address and
gets the slow loop's memory samples back; with ``picker.shared_view`` it decides on the sum over every
picker (:mod:`ext_proc.load_client`).
Later routing and endpoint changes apply at once; a change of process settings (session table,
admission) is logged and needs a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from ext_proc import transport
from ext_proc.handler import PickerHandler
from ext_proc.kv_events import start_feed
from ext_proc.load_client import run_load_view
from ext_proc.settings import METADATA_KEY, PickerSettings, from_wire
from ext_proc.shared_load import SharedLoad
from ext_proc.transport.base import TlsFiles
from ext_proc.view import RoutingTable, ViewHolder
from ext_proc.xds_client import XdsSubscriber
from inferlb.listeners import binding

__all__ = ["picker_config", "run_picker", "run_workers"]

log = logging.getLogger(__name__)


def picker_config(clusters: dict[str, cluster_pb2.Cluster]) -> tuple[RoutingTable, PickerSettings] | None:
    """The routing table and settings carried by a cluster's ``inferlb.picker`` metadata, or None.

    Raises:
        ValueError / KeyError / TypeError: the metadata is there but invalid.
    """
    for name in sorted(clusters):
        meta = clusters[name].metadata.filter_metadata
        if METADATA_KEY in meta:
            return from_wire(json_format.MessageToDict(meta[METADATA_KEY]))
    return None


async def run_picker(
    xds: str,
    listen: str,
    *,
    kind: str = "fast",
    node_id: str,
    reuse_port: bool = False,
    tls: TlsFiles | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run one picker process until ``stop`` is set or SIGINT/SIGTERM arrives.

    Args:
        xds: the control plane's ADS address (``HOST:PORT``).
        listen: where to serve ext_proc and the access log (``HOST:PORT``, port 0 = any).
        kind: the transport, ``fast`` or ``grpcio`` (:data:`ext_proc.transport.KINDS`).
        node_id: the xDS node id.
        reuse_port: SO_REUSEPORT (several worker processes on one port).
        tls: serve TLS (and mTLS with ``tls.require_client_cert``).
        ready: called with the bound port once serving.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    holder = ViewHolder()
    first: asyncio.Future[PickerSettings] = loop.create_future()

    def on_update(clusters: dict[str, cluster_pb2.Cluster], assignments: dict[str, bytes]) -> bool:
        """Build the view from the subscription; False (the update is refused) when it cannot be."""
        try:
            config = picker_config(clusters)
        except (ValueError, KeyError, TypeError) as err:
            log.error("invalid picker metadata from the control plane (%s); keeping the last good view", err)
            return False
        if config is None:
            log.warning("no cluster carries %r metadata yet; not serving", METADATA_KEY)
            return True
        routing, settings = config
        try:
            holder.update(assignments, routing)
        except (ValueError, DecodeError) as err:
            log.error("cannot build the endpoint view (%s); keeping the last good one", err)
            return False
        if not first.done():
            first.set_result(settings)
        elif settings != first.result():
            log.warning("picker settings changed in the control plane; restart the picker to apply them")
        return True

    subscriber = XdsSubscriber(xds, node_id, on_update)
    subscription = asyncio.create_task(subscriber.run())
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({first, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            return
        handler = PickerHandler.from_settings(holder, first.result())
        with binding("--listen", listen, reuse_port=reuse_port):
            server, port = await transport.start(kind, handler, listen, tls=tls, reuse_port=reuse_port)
        log.info("picker serving on port %d (%s transport), fed by %s", port, kind, xds)
        if ready is not None:
            ready(port)
        # The load view also brings the slow loop's memory samples; with ``shared_view`` off the picker
        # still reports (the admin API shows its share) but decides on its own load alone.
        s = first.result()
        shared = handler.control.share_load() if s.shared_view else SharedLoad(handler.control.inflight)
        tasks = [asyncio.create_task(handler.maintain()),
                 asyncio.create_task(run_load_view(xds, node_id, shared, s.shared_view_interval_s,
                                                   s.shared_view_expiry_s, handler.control.set_samples,
                                                   on_view=handler.control.others_changed))]
        feed = start_feed(handler.control.prefixes, holder, s)
        if feed is not None:
            tasks.append(feed)
        try:
            await waiter
        finally:
            for task in tasks:
                task.cancel()
            await server.stop(1.0)
    finally:
        subscription.cancel()
        waiter.cancel()


def run_workers(argv: Sequence[str], workers: int, node_id: str | None) -> int:
    """Run ``workers`` picker processes (``python -m inferlb ext-proc ARGV --reuse-port``) sharing one
    port, forward SIGTERM/SIGINT to them, and return the worst exit code.

    One picker process per Envoy worker: SO_REUSEPORT spreads connections, not requests.
    """
    children = [subprocess.Popen([sys.executable, "-m", "inferlb", "ext-proc", *argv, "--reuse-port",
                                  *(["--node-id", f"{node_id}-{i}"] if node_id else [])])
                for i in range(workers)]

    def forward(signum, _frame):
        for child in children:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(child.wait() for child in children)
