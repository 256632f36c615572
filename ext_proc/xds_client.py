"""The picker's own ADS subscription: CDS (wildcard) and EDS for every EDS cluster, State-of-the-World.

A standalone picker (``inferlb ext-proc --xds``) learns endpoints exactly as Envoy does, from the
same control plane: one source of truth for Envoy and every picker. Its routing table and
settings come in the metadata of the cluster that carries ``filter_metadata["inferlb.picker"]``.

Protocol (Envoy's xDS protocol doc): every response is ACKed with its ``version_info`` and
``nonce``; CDS responses carry every cluster; EDS responses from inferlb carry the assignments
that changed (names compared as sets), so assignments are merged and dropped only when their
cluster leaves CDS. A broken stream is re-opened with a capped back-off; the last good view stays.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

__all__ = ["CLUSTER_TYPE", "ENDPOINT_TYPE", "XdsSubscriber"]

log = logging.getLogger(__name__)

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_MAX_MESSAGE = 64 * 1024 * 1024

Update = Callable[[dict[str, cluster_pb2.Cluster], dict[str, endpoint_pb2.ClusterLoadAssignment]], None]


class XdsSubscriber:
    """Subscribes to CDS + EDS over ADS and reports every change.

    Args:
        address: the control plane's ADS server, ``HOST:PORT``.
        node_id: this picker's xDS node id (the control plane lists it in ``/api/v1/nodes``).
        on_update: called with ``(clusters, assignments)`` (name -> message; the dicts are the
            subscriber's own, read them before returning) after every accepted response.
        node_cluster: the xDS node cluster.

    Attributes:
        connected: True while a stream is open.
    """

    def __init__(self, address: str, node_id: str, on_update: Update, node_cluster: str = "inferlb-picker") -> None:
        self._address = address
        self._node = base_pb2.Node(id=node_id, cluster=node_cluster)
        self._on_update = on_update
        self.clusters: dict[str, cluster_pb2.Cluster] = {}
        self.assignments: dict[str, endpoint_pb2.ClusterLoadAssignment] = {}
        self.connected = False

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

        eds_names: frozenset[str] = frozenset()
        eds_version = eds_nonce = ""
        async with grpc.aio.insecure_channel(self._address, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE)]) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(requests())
            outbox.put_nowait(discovery_pb2.DiscoveryRequest(node=self._node, type_url=CLUSTER_TYPE))
            self.connected = True
            async for response in call:
                if response.type_url == CLUSTER_TYPE:
                    clusters = {}
                    for any_ in response.resources:
                        cluster = cluster_pb2.Cluster()
                        any_.Unpack(cluster)
                        clusters[cluster.name] = cluster
                    self.clusters = clusters
                    outbox.put_nowait(discovery_pb2.DiscoveryRequest(
                        node=self._node, type_url=CLUSTER_TYPE, version_info=response.version_info,
                        response_nonce=response.nonce))
                    names = frozenset(n for n, c in clusters.items() if c.type == cluster_pb2.Cluster.EDS)
                    for gone in set(self.assignments) - names:
                        del self.assignments[gone]
                    if names != eds_names:
                        eds_names = names
                        outbox.put_nowait(discovery_pb2.DiscoveryRequest(
                            node=self._node, type_url=ENDPOINT_TYPE, resource_names=sorted(names),
                            version_info=eds_version, response_nonce=eds_nonce))
                elif response.type_url == ENDPOINT_TYPE:
                    for any_ in response.resources:
                        assignment = endpoint_pb2.ClusterLoadAssignment()
                        any_.Unpack(assignment)
                        if assignment.cluster_name in eds_names:
                            self.assignments[assignment.cluster_name] = assignment
                    eds_version, eds_nonce = response.version_info, response.nonce
                    outbox.put_nowait(discovery_pb2.DiscoveryRequest(
                        node=self._node, type_url=ENDPOINT_TYPE, resource_names=sorted(eds_names),
                        version_info=eds_version, response_nonce=eds_nonce))
                else:
                    continue
                self._on_update(self.clusters, self.assignments)
