"""The ADS gRPC server (grpc.aio): streams the current :class:`Snapshot` to every connected Envoy.

Each stream runs its own task: a slow Envoy only slows its own stream. A new snapshot wakes every
stream, which sends what changed for it (see :mod:`xds_server.ads.sotw`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import Counter, Gauge

from ..snapshot import Snapshot
from .sotw import SotwStream

log = logging.getLogger(__name__)

XDS_REQUESTS = Counter("inferlb_xds_requests_total", "xDS requests received, by type and kind",
                       ["type", "kind"])
XDS_RESPONSES = Counter("inferlb_xds_responses_total", "xDS responses sent, by type", ["type"])
XDS_STREAMS = Gauge("inferlb_xds_streams", "Connected ADS streams")
XDS_REFUSED = Counter("inferlb_xds_streams_refused_total", "ADS streams refused: max_xds_streams reached")
#: 64 MiB: a SotW CDS/EDS response for a large fleet exceeds gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: A DiscoveryRequest is small (resource names, an ACK/NACK); 8 MiB is room for ~100k names.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: Requests read ahead of processing, per stream; the reader then waits (HTTP/2 flow control
#: pushes back on the client), so a client flooding requests can't grow our memory.
INBOX_SIZE = 16


def short_type(type_url: str) -> str:
    """``type.googleapis.com/envoy.config.cluster.v3.Cluster`` -> ``Cluster``."""
    return type_url.rsplit(".", 1)[-1]


@dataclass
class NodeStream:
    """One connected Envoy, as the admin API shows it."""

    node_id: str
    node_cluster: str
    peer: str
    protocol: str
    connected_since: float = field(default_factory=time.time)
    state: SotwStream = field(default_factory=SotwStream)

    def describe(self) -> dict:
        """JSON-ready view: per type the ACKed version, last NACK reason, pending nonce, counts."""
        types = {}
        for type_url, st in self.state.types.items():
            types[short_type(type_url)] = {
                "acked_version": st.acked,
                "sent_version": st.sent_type_version,
                "pending_nonce": st.nonce if st.nonce and st.acked != st.sent_type_version else None,
                "last_nack": st.nack,
                "last_nack_at": st.nack_at,
                "acks": st.acks,
                "nacks": st.nacks,
                "subscribed": len(st.subscribed),
            }
        return {
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "peer": self.peer,
            "protocol": self.protocol,
            "connected_since": self.connected_since,
            "types": types,
        }


class SnapshotCache:
    """Holds the current snapshot; ``set`` wakes every waiting stream."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self._changed = asyncio.Condition()

    async def set(self, snap: Snapshot) -> None:
        """Publish ``snap`` (no-op when its version equals the current one)."""
        if self.snapshot is not None and self.snapshot.version == snap.version:
            return
        async with self._changed:
            self.snapshot = snap
            self._changed.notify_all()

    async def wait_change(self, version: str | None) -> None:
        """Return once the snapshot's version differs from ``version``."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.snapshot is not None and self.snapshot.version != version)


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """AggregatedDiscoveryService: State-of-the-World streams.

    ``max_streams``: streams served at once; one more is ended at once with RESOURCE_EXHAUSTED
    (Envoy retries with back-off), so a flood of streams can't exhaust memory.
    """

    def __init__(self, cache: SnapshotCache, max_streams: int = 1024) -> None:
        self.cache = cache
        self.nodes: dict[int, NodeStream] = {}
        self.max_streams = max_streams
        self.open_streams = 0

    def describe_nodes(self) -> list[dict]:
        """Every connected stream, for ``/api/v1/nodes``."""
        return [n.describe() for n in list(self.nodes.values())]

    async def StreamAggregatedResources(self, request_iterator, context):  # noqa: N802 (gRPC name)
        if self.open_streams >= self.max_streams:
            XDS_REFUSED.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"inferlb serves at most {self.max_streams} ADS streams at once")
            return
        self.open_streams += 1
        try:
            async for resp in self._stream(request_iterator, context):
                yield resp
        finally:
            self.open_streams -= 1

    async def _stream(self, request_iterator, context):
        inbox: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue(INBOX_SIZE)
        node: NodeStream | None = None

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await inbox.put(req)
            except grpc.aio.AioRpcError:
                pass
            # The client is done (or broke): tell the loop. Not when cancelled: the stream is already
            # closing, and the inbox may be full with no one left to make room.
            await inbox.put(None)

        reader = asyncio.create_task(read())
        XDS_STREAMS.inc()
        try:
            seen_version: str | None = None
            while True:
                get = asyncio.create_task(inbox.get())
                change = asyncio.create_task(self.cache.wait_change(seen_version))
                done, _ = await asyncio.wait({get, change}, return_when=asyncio.FIRST_COMPLETED)
                change.cancel()
                if get not in done:
                    get.cancel()
                else:
                    req = get.result()
                    if req is None:
                        return
                    if node is None:
                        node = NodeStream(req.node.id, req.node.cluster, context.peer(), "sotw")
                        self.nodes[id(node)] = node
                        log.info("xDS stream from node %s (%s) at %s", node.node_id, node.node_cluster, node.peer)
                    kind = node.state.on_request(req)
                    XDS_REQUESTS.labels(short_type(req.type_url), kind).inc()
                    if kind == "nack":
                        log.warning("NACK from node %s for %s version %s: %s", node.node_id,
                                    short_type(req.type_url), node.state.types[req.type_url].sent_type_version,
                                    node.state.types[req.type_url].nack)
                snap = self.cache.snapshot
                seen_version = snap.version if snap else None
                if node is not None:
                    for resp in node.state.pending(snap):
                        XDS_RESPONSES.labels(short_type(resp.type_url)).inc()
                        yield resp
        finally:
            reader.cancel()
            XDS_STREAMS.dec()
            if node is not None:
                self.nodes.pop(id(node), None)
                log.info("xDS stream from node %s closed", node.node_id)


async def start_ads_server(cache: SnapshotCache, address: str, *, max_streams: int = 1024,
                           credentials: grpc.ServerCredentials | None = None,
                           ) -> tuple[grpc.aio.Server, AdsServicer, int]:
    """Bind and start the ADS server on ``address`` (``HOST:PORT``, port 0 = any).

    ``credentials``: TLS server credentials (None = plaintext); ``max_streams``: see :class:`AdsServicer`.
    Returns ``(server, servicer, bound_port)``. Raises ``RuntimeError`` if the address can't be bound.
    """
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    servicer = AdsServicer(cache, max_streams)
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"cannot bind the xDS server to {address}")
    await server.start()
    return server, servicer, port
