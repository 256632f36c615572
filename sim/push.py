"""Push this node's status to inferlb over its own gRPC API (``inferlb.v1.NodeStatusService.Push``).

One client stream, one ``NodeStatus`` every ``interval_s``: running and waiting requests, free GPU
memory (MiB), KV-cache use and GPU utilisation (0–1). If the stream breaks (inferlb restarting,
not up yet) it reconnects with a capped back-off. The ``push`` fault (``stop``) pauses the messages
without closing the stream, so the control plane sees the status age.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from protos import node_status_pb2, node_status_pb2_grpc

if TYPE_CHECKING:
    from sim.node import SimNode

log = logging.getLogger("inferlb.sim.push")


def status_message(node: SimNode, instance: str) -> node_status_pb2.NodeStatus:
    """The node's status now, as a NodeStatus for ``instance``."""
    g = node.gauges()
    return node_status_pb2.NodeStatus(
        instance=instance, running=g.running, queue=g.waiting, gpu_memory_free_mib=g.fb_free_mib,
        kv_cache_usage=g.kv_usage, gpu_utilization=g.gpu_util_percent / 100.0)


async def push_status(node: SimNode, target: str, interval_s: float, instance: str) -> None:
    """Stream ``node``'s status to ``target`` (``HOST:PORT``) until cancelled; reconnects on failure."""
    backoff = 0.1

    async def messages() -> AsyncIterator[node_status_pb2.NodeStatus]:
        while not node.faults.closing:
            if node.faults.push == "ok":
                yield status_message(node, instance)
            await asyncio.sleep(interval_s)

    while True:
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = node_status_pb2_grpc.NodeStatusServiceStub(channel)
                summary = await stub.Push(messages())
                log.info("node-status stream ended: %d accepted, %d rejected %s", summary.accepted,
                         summary.rejected, summary.last_error)
                backoff = 0.1
        except grpc.aio.AioRpcError as err:
            log.debug("node-status push to %s failed: %s", target, err.code())
        if node.faults.closing:
            return
        await asyncio.sleep(backoff)
        backoff = min(2.0, backoff * 2)
