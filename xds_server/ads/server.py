"""The ADS gRPC server (grpc.aio): streams each connected Envoy its node group's snapshot.

Both protocols: ``StreamAggregatedResources`` (State-of-the-World, :mod:`xds_server.ads.sotw`) and
``DeltaAggregatedResources`` (incremental, :mod:`xds_server.ads.delta`); the client chooses.
Each stream runs its own task and sends the newest published snapshot when it is free: one push in
flight per stream, a slow Envoy only slows its own stream and skips intermediate snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from prometheus_client import Counter, Gauge

from xds_server.ads.cache import SnapshotCache
from xds_server.ads.delta import DeltaStream
from xds_server.ads.push import WireCache
from xds_server.ads.sotw import SotwStream

log = logging.getLogger(__name__)

XDS_REQUESTS = Counter("inferlb_xds_requests_total", "xDS requests received, by protocol, type and kind",
                       ["protocol", "type", "kind"])
XDS_RESPONSES = Counter("inferlb_xds_responses_total", "xDS responses sent, by protocol and type",
                        ["protocol", "type"])
XDS_BYTES = Counter("inferlb_xds_sent_bytes_total", "Serialized bytes of xDS responses sent, by protocol and type",
                    ["protocol", "type"])
XDS_STREAMS = Gauge("inferlb_xds_streams", "Connected ADS streams, by protocol", ["protocol"])
#: 64 MiB: a SotW CDS/EDS response for a large fleet exceeds gRPC's 4 MiB default. The Envoy side
#: is ``ads_config.grpc_services[].envoy_grpc.max_receive_message_length``, which the rendered
#: bootstrap sets to the same value (see xds_server/resources/bootstrap.yaml).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
XDS_REFUSED = Counter("inferlb_xds_streams_refused_total", "ADS streams refused: max_xds_streams reached")
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
    """One connected Envoy (one ADS stream), as the admin API shows it.

    ``state`` is the stream's protocol state: a :class:`SotwStream` or a :class:`DeltaStream`.
    """

    node_id: str
    node_cluster: str
    peer: str
    state: SotwStream | DeltaStream
    connected_since: float = field(default_factory=time.time)
    sent_bytes: int = 0

    def describe(self) -> dict:
        """JSON-ready view: protocol, and per type the ACKed and sent versions, pending nonces,
        the last NACK reason and when, ACK/NACK counts, subscription size."""
        types = {}
        for type_url, st in self.state.types.items():
            if not st.requested:
                continue
            doc = {
                "acked_version": st.acked,
                "sent_version": st.sent_type_version,
                "pending_nonces": st.pending_nonces(),
                "last_nack": st.nack,
                "last_nack_at": st.nack_at,
                "acks": st.acks,
                "nacks": st.nacks,
                "wildcard": st.wildcard,
                "subscribed": len(st.subscribed),
            }
            if isinstance(self.state, DeltaStream):
                doc["resources_known"] = len(st.known)
            types[short_type(type_url)] = doc
        return {
            "node_id": self.node_id,
            "node_cluster": self.node_cluster,
            "peer": self.peer,
            "protocol": self.state.protocol,
            "connected_since": self.connected_since,
            "sent_bytes": self.sent_bytes,
            "types": types,
        }


class AdsServicer:
    """AggregatedDiscoveryService over a :class:`SnapshotCache`: SotW and delta streams.

    The stream methods yield wire bytes (see :mod:`xds_server.ads.push`); register the servicer with
    :func:`add_ads_servicer`, whose serializer passes them through.

    ``max_streams``: streams served at once; one more is ended at once with RESOURCE_EXHAUSTED
    (Envoy retries with back-off), so a flood of streams can't exhaust memory.
    """

    def __init__(self, cache: SnapshotCache, max_streams: int = 1024) -> None:
        self.cache = cache
        self.nodes: dict[int, NodeStream] = {}
        self.wire = WireCache()
        self.max_streams = max_streams
        self.open_streams = 0

    def describe_nodes(self) -> list[dict]:
        """Every connected stream, for ``/api/v1/nodes``, ordered by node id."""
        return sorted((n.describe() for n in list(self.nodes.values())), key=lambda d: (d["node_id"], d["peer"]))

    async def StreamAggregatedResources(self, request_iterator, context):  # noqa: N802 (gRPC name)
        async for resp in self._serve(SotwStream(self.wire), request_iterator, context):
            yield resp

    async def DeltaAggregatedResources(self, request_iterator, context):  # noqa: N802 (gRPC name)
        async for resp in self._serve(DeltaStream(self.wire), request_iterator, context):
            yield resp

    async def _serve(self, state: SotwStream | DeltaStream, request_iterator, context):
        if self.open_streams >= self.max_streams:
            XDS_REFUSED.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"inferlb serves at most {self.max_streams} ADS streams at once")
            return
        self.open_streams += 1
        try:
            async for resp in self._stream(state, request_iterator, context):
                yield resp
        finally:
            self.open_streams -= 1

    async def _stream(self, state: SotwStream | DeltaStream, request_iterator, context):
        protocol = state.protocol
        inbox: asyncio.Queue = asyncio.Queue(INBOX_SIZE)
        wake = asyncio.Event()  # a request arrived or the cache published
        node: NodeStream | None = None

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await inbox.put(req)
                    wake.set()
            except grpc.aio.AioRpcError:
                pass
            # The client is done (or broke): tell the loop. Not when cancelled: the stream is already
            # closing, and the inbox may be full with no one left to make room.
            await inbox.put(None)
            wake.set()

        reader = asyncio.create_task(read())
        self.cache.listen(wake)
        XDS_STREAMS.labels(protocol).inc()
        try:
            generation = self.cache.generation
            while True:
                wake.clear()
                if inbox.empty() and generation == self.cache.generation:
                    await wake.wait()
                    continue
                if not inbox.empty():
                    req = inbox.get_nowait()
                    if req is None:
                        return
                    if node is None:
                        node = NodeStream(req.node.id, req.node.cluster, context.peer(), state)
                        self.nodes[id(node)] = node
                        log.info("%s xDS stream from node %s (%s) at %s", protocol, node.node_id,
                                 node.node_cluster, node.peer)
                    kind = state.on_request(req)
                    XDS_REQUESTS.labels(protocol, short_type(req.type_url), kind).inc()
                    if kind == "nack":
                        st = state.types[req.type_url]
                        log.warning("NACK from node %s for %s (sent version %s): %s", node.node_id,
                                    short_type(req.type_url), st.sent_type_version, st.nack)
                generation = self.cache.generation
                if node is None:
                    continue
                for push in state.plan(self.cache.snapshot_for(node.node_cluster)):
                    data = self.wire.encode(push)
                    node.sent_bytes += len(data)
                    XDS_BYTES.labels(protocol, short_type(push.type_url)).inc(len(data))
                    XDS_RESPONSES.labels(protocol, short_type(push.type_url)).inc()
                    yield data
        finally:
            self.cache.unlisten(wake)
            reader.cancel()
            XDS_STREAMS.labels(protocol).dec()
            if node is not None:
                self.nodes.pop(id(node), None)
                log.info("xDS stream from node %s closed", node.node_id)


def _wire(data: bytes) -> bytes:
    return data


def add_ads_servicer(servicer: AdsServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as ``envoy.service.discovery.v3.AggregatedDiscoveryService`` on ``server``
    (requests parsed as usual, responses already encoded)."""
    handler = grpc.method_handlers_generic_handler(ADS_SERVICE, {
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources, request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
            response_serializer=_wire),
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources, request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
            response_serializer=_wire),
    })
    server.add_generic_rpc_handlers((handler,))


async def start_ads_server(cache: SnapshotCache, address: str, servicer_cls: type[AdsServicer] = AdsServicer, *,
                           max_streams: int = 1024, credentials: grpc.ServerCredentials | None = None,
                           services: Sequence[Callable[[grpc.aio.Server], None]] = (),
                           ) -> tuple[grpc.aio.Server, AdsServicer, int]:
    """Bind and start the ADS server on ``address`` (``HOST:PORT``, port 0 = any).

    ``credentials``: TLS server credentials (None = plaintext); ``max_streams``: see :class:`AdsServicer`;
    ``services``: hooks that add more gRPC services to the same server before it starts (e.g. the
    load view, :func:`xds_server.loadview.service.add_load_view_servicer`).

    Messages up to :data:`MAX_MESSAGE_BYTES` (64 MiB) each way. Returns ``(server, servicer,
    bound_port)``. Raises ``RuntimeError`` if the address can't be bound.
    """
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),  # grpc's default 1 lets a second control plane share the port silently
    ])
    servicer = servicer_cls(cache, max_streams)
    add_ads_servicer(servicer, server)
    for add in services:
        add(server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"cannot bind the xDS server to {address}")
    await server.start()
    return server, servicer, port
