"""The picker's own ADS subscription: CDS (wildcard) and EDS for every EDS cluster, State-of-the-World.

A standalone picker (``inferlb ext-proc --xds``) learns endpoints exactly as Envoy does, from the
same control plane: one source of truth for Envoy and every picker. Its routing table and
settings come in the metadata of the cluster that carries ``filter_metadata["inferlb.picker"]``.

Protocol (Envoy's xDS protocol doc): every response is ACKed with its ``version_info`` and
``nonce``; CDS responses carry every cluster; EDS responses from inferlb carry the assignments
that changed (names compared as sets), so assignments are merged and dropped only when their
cluster leaves CDS. A broken stream is re-opened with a capped back-off; the last good view stays.

Assignments are kept as the response's bytes (:data:`ext_proc.eds_wire.Assignment`): only their
``cluster_name`` is read (:func:`ext_proc.eds_wire.cluster_name`), and the view's decoder walks the
bytes, so an update is neither parsed into messages nor serialised again on the picker's event
loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from ext_proc.eds_wire import cluster_name

__all__ = ["CLUSTER_TYPE", "ENDPOINT_TYPE", "XdsSubscriber"]

log = logging.getLogger(__name__)

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_MAX_MESSAGE = 64 * 1024 * 1024

Update = Callable[[dict[str, cluster_pb2.Cluster], dict[str, bytes]], bool]


class XdsSubscriber:
    """Subscribes to CDS + EDS over ADS and reports every change.

    Args:
        address: the control plane's ADS server, ``HOST:PORT``.
        node_id: this picker's xDS node id (the control plane lists it in ``/api/v1/nodes``).
        on_update: called with ``(clusters, assignments)`` (name -> Cluster message; name ->
            serialised ClusterLoadAssignment; read them before returning) for every response; it
            returns whether it took them: an EDS response it refuses is NACKed and the previous
            assignments stay.
        node_cluster: the xDS node cluster.

    Attributes:
        connected: True while a stream is open.
    """

    def __init__(self, address: str, node_id: str, on_update: Update, node_cluster: str = "inferlb-picker") -> None:
        self._address = address
        self._node = base_pb2.Node(id=node_id, cluster=node_cluster)
        self._on_update = on_update
        self.clusters: dict[str, cluster_pb2.Cluster] = {}
        self.assignments: dict[str, bytes] = {}
        self.connected = False
        self._eds_names: frozenset[str] = frozenset()  # the EDS subscription of the open stream
        self._eds_version = self._eds_nonce = ""

    async def run(self, backoff_s: float = 0.25, max_backoff_s: float = 5.0) -> None:
        """Keep a stream open until cancelled, reconnecting after failures."""
        delay = backoff_s
        while True:
            try:
                await self._stream()
                delay = backoff_s
            except grpc.aio.AioRpcError as err:
                log.warning("ADS stream to %s failed: %s; retrying in %.2f s", self._address, err.code().name, delay)
            finally:
                self.connected = False
            await asyncio.sleep(delay)
            delay = min(max_backoff_s, delay * 2)

    async def _stream(self) -> None:
        outbox: asyncio.Queue[discovery_pb2.DiscoveryRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                yield await outbox.get()

        self._eds_names, self._eds_version, self._eds_nonce = frozenset(), "", ""
        async with grpc.aio.insecure_channel(self._address, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE)]) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
            outbox.put_nowait(discovery_pb2.DiscoveryRequest(node=self._node, type_url=CLUSTER_TYPE))
            self.connected = True
            async for response in call:
                if response.type_url == CLUSTER_TYPE:
                    for request in self._take_clusters(response):
                        outbox.put_nowait(request)
                elif response.type_url == ENDPOINT_TYPE:
                    outbox.put_nowait(self._take_assignments(response))

    def _eds_request(self, nonce: str, error: str | None = None) -> discovery_pb2.DiscoveryRequest:
        return discovery_pb2.DiscoveryRequest(
            node=self._node, type_url=ENDPOINT_TYPE, resource_names=sorted(self._eds_names),
            version_info=self._eds_version, response_nonce=nonce,
            error_detail=None if error is None else status_pb2.Status(code=3, message=error))  # INVALID_ARGUMENT

    def _take_clusters(self, response: discovery_pb2.DiscoveryResponse) -> list[discovery_pb2.DiscoveryRequest]:
        """A CDS response: every cluster. Its ACK, and a new EDS subscription when the EDS clusters changed."""
        clusters = {}
        for any_ in response.resources:
            cluster = cluster_pb2.Cluster()
            any_.Unpack(cluster)
            clusters[cluster.name] = cluster
        self.clusters = clusters
        out = [discovery_pb2.DiscoveryRequest(node=self._node, type_url=CLUSTER_TYPE,
                                              version_info=response.version_info, response_nonce=response.nonce)]
        names = frozenset(n for n, c in clusters.items() if c.type == cluster_pb2.Cluster.EDS)
        self.assignments = {n: a for n, a in self.assignments.items() if n in names}
        if names != self._eds_names:
            self._eds_names = names
            out.append(self._eds_request(self._eds_nonce))
        self._on_update(self.clusters, self.assignments)  # a refusal keeps the picker's last good view
        return out

    def _take_assignments(self, response: discovery_pb2.DiscoveryResponse) -> discovery_pb2.DiscoveryRequest:
        """An EDS response (the assignments that changed): its ACK, or a NACK (``error_detail``) when a
        resource is not a ClusterLoadAssignment or ``on_update`` refuses them; then nothing changes."""
        try:
            update = _named_assignments(response.resources)
        except DecodeError as err:
            return self._refuse(response, str(err))
        candidate = {**self.assignments, **{n: a for n, a in update.items() if n in self._eds_names}}
        if not self._on_update(self.clusters, candidate):
            return self._refuse(response, "the picker cannot build its endpoint view from it")
        self.assignments = candidate
        self._eds_version, self._eds_nonce = response.version_info, response.nonce
        return self._eds_request(response.nonce)

    def _refuse(self, response: discovery_pb2.DiscoveryResponse, why: str) -> discovery_pb2.DiscoveryRequest:
        log.error("EDS response %s refused (NACK): %s", response.version_info, why)
        self._eds_nonce = response.nonce
        return self._eds_request(response.nonce, why)


def _named_assignments(resources) -> dict[str, bytes]:
    """``{cluster_name: serialised ClusterLoadAssignment}`` of an EDS response's resources (``Any``).

    Raises:
        google.protobuf.message.DecodeError: a resource is not a ClusterLoadAssignment (its type URL,
            or its bytes at the top level).
    """
    out = {}
    for any_ in resources:
        if any_.type_url != ENDPOINT_TYPE:
            raise DecodeError(f"resource of type {any_.type_url!r} in an EDS response")
        out[cluster_name(any_.value)] = any_.value
    return out
