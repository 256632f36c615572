"""The ``push`` metrics source: nodes stream ``inferlb.v1.NodeStatus`` to the control plane (gRPC).

A node, or a sidecar next to it, opens one client-streaming ``NodeStatusService.Push`` call and
sends its in-flight count, queue, free GPU memory, KV-cache use and GPU utilisation every 100 ms to
1 s (API: ``protos/inferlb/v1/node_status.proto``). The newest message per instance is kept with its
receive time; :meth:`PushSource.fetch` reports it with ``sample_age_s`` = time since it arrived, so
a node that stops pushing goes stale like any other source. Messages for instances not in the
config, or with negative or non-finite values, are refused and counted.

Thread-safety: the gRPC handler runs on the event loop, ``fetch`` in the round's worker thread;
one lock guards the table.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace

import grpc
from prometheus_client import Counter

from protos import node_status_pb2, node_status_pb2_grpc
from xds_server.metrics.stats import EndpointStats

log = logging.getLogger(__name__)

PUSHED = Counter("inferlb_node_status_messages_total", "NodeStatus messages received, by outcome", ["outcome"])

#: NodeStatus field -> EndpointStats field.
FIELDS = {"running": "running", "queue": "queue", "gpu_memory_free_mib": "gpu_mem_free_mib",
          "kv_cache_usage": "kv_cache", "gpu_utilization": "gpu_util"}


class BadStatus(ValueError):
    """A NodeStatus message that cannot be used (the message says why)."""


@dataclass(frozen=True, slots=True)
class Received:
    """The newest status of one instance and when it arrived (``time.time()`` s)."""

    at: float
    stats: EndpointStats


def to_stats(msg: node_status_pb2.NodeStatus) -> EndpointStats:
    """The fields set in ``msg`` as :class:`EndpointStats` (``in_flight`` = running + queue when both are set).

    Raises:
        BadStatus: a value is negative or not finite, or a 0–1 value is above 1.
    """
    values: dict[str, float] = {}
    for pb_name, field in FIELDS.items():
        if msg.HasField(pb_name):
            v = getattr(msg, pb_name)
            if not math.isfinite(v) or v < 0:
                raise BadStatus(f"{pb_name} must be a finite number >= 0, got {v}")
            if pb_name in ("kv_cache_usage", "gpu_utilization") and v > 1:
                raise BadStatus(f"{pb_name} is a fraction 0-1, got {v}")
            values[field] = v
    if "running" in values and "queue" in values:
        values["in_flight"] = values["running"] + values["queue"]
    return EndpointStats(**values)


class PushSource(node_status_pb2_grpc.NodeStatusServiceServicer):
    """Keeps the newest pushed status of each known instance (``instances``: the configured ones)."""

    name = "push"

    def __init__(self, instances: Iterable[str]) -> None:
        self._known = frozenset(instances)
        self._latest: dict[str, Received] = {}
        self._lock = threading.Lock()
        self.accepted = 0
        self.rejected = 0

    def record(self, msg: node_status_pb2.NodeStatus, at: float | None = None) -> None:
        """Keep ``msg`` as the newest status of its instance. Raises BadStatus (unknown instance, bad value)."""
        if msg.instance not in self._known:
            raise BadStatus(f"unknown instance {msg.instance!r} (not an endpoint in the config)")
        stats = to_stats(msg)
        with self._lock:
            self._latest[msg.instance] = Received(time.time() if at is None else at, stats)

    def fetch(self, instances: Iterable[str], now: float | None = None) -> dict[str, EndpointStats]:
        """``{instance: pushed stats with sample_age_s}`` for the instances that ever pushed (no I/O)."""
        now = time.time() if now is None else now
        with self._lock:
            latest = dict(self._latest)
        out = {}
        for inst in instances:
            r = latest.get(inst)
            if r is not None:
                out[inst] = replace(r.stats, sample_age_s=max(0.0, now - r.at))
        return out

    async def Push(self, request_iterator: AsyncIterator[node_status_pb2.NodeStatus],  # noqa: N802 (gRPC name)
                   context: grpc.aio.ServicerContext) -> node_status_pb2.PushSummary:
        """The gRPC handler: record every message of the stream; answer with the counts when it ends."""
        accepted = rejected = 0
        last_error = ""
        async for msg in request_iterator:
            try:
                self.record(msg)
            except BadStatus as err:
                rejected += 1
                self.rejected += 1
                PUSHED.labels("rejected").inc()
                if str(err) != last_error:
                    log.warning("node status from %s refused: %s", context.peer(), err)
                last_error = str(err)
                continue
            accepted += 1
            self.accepted += 1
            PUSHED.labels("accepted").inc()
        return node_status_pb2.PushSummary(accepted=accepted, rejected=rejected, last_error=last_error)

    def describe(self) -> dict:
        """Counters and the instances that pushed, for the admin API."""
        with self._lock:
            pushing = sorted(self._latest)
        return {"accepted": self.accepted, "rejected": self.rejected, "instances": pushing}


async def start_push_server(source: PushSource, address: str) -> tuple[grpc.aio.Server, int]:
    """Serve ``NodeStatusService`` on ``address`` (``HOST:PORT``, port 0 = any); returns ``(server, port)``.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # a taken port fails, not shared silently
    node_status_pb2_grpc.add_NodeStatusServiceServicer_to_server(source, server)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot bind the node-status server to {address}")
    await server.start()
    return server, bound
