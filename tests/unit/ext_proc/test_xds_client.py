"""The standalone picker's ADS subscription (``ext_proc.xds_client``) against an ADS server in this
process that sends what a faulty control plane could: it keeps EDS resources as bytes, ACKs what
it took, and NACKs (``error_detail``, the previous ``version_info``) what it could not read,
keeping the last good assignments."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from ext_proc.eds_wire import assignment_endpoints
from ext_proc.xds_client import CLUSTER_TYPE, ENDPOINT_TYPE, XdsSubscriber


def _cla(name: str, host: str) -> bytes:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    sock = cla.endpoints.add().lb_endpoints.add().endpoint.address.socket_address
    sock.address, sock.port_value = host, 8000
    return cla.SerializeToString()


GOOD_1, GOOD_2 = _cla("chat-v1", "10.0.0.1"), _cla("chat-v1", "10.0.0.2")
#: Well-formed at the top level (the name reads), but inside its one locality a field runs past the
#: locality's 2 bytes: only the view's decoder sees it.
BAD_INSIDE = endpoint_pb2.ClusterLoadAssignment(cluster_name="chat-v1").SerializeToString() + b"\x12\x02\x0a\x07"
EDS_SCRIPT = [  # (version_info, resources)
    ("1", [any_pb2.Any(type_url=ENDPOINT_TYPE, value=GOOD_1)]),
    ("2", [any_pb2.Any(type_url=ENDPOINT_TYPE, value=b"\x0a\x05abc")]),  # not a message at all
    ("3", [any_pb2.Any(type_url=CLUSTER_TYPE, value=GOOD_2)]),  # the wrong type
    ("4", [any_pb2.Any(type_url=ENDPOINT_TYPE, value=BAD_INSIDE)]),
    ("5", [any_pb2.Any(type_url=ENDPOINT_TYPE, value=GOOD_2)]),
]


class ScriptedAds(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Answers the CDS request with one EDS cluster, then sends EDS_SCRIPT one response per EDS request."""

    def __init__(self) -> None:
        self.eds_requests: list[discovery_pb2.DiscoveryRequest] = []
        self.done = asyncio.Event()

    async def StreamAggregatedResources(self, requests, context):  # noqa: N802 (gRPC's name)
        script = iter(EDS_SCRIPT)
        async for req in requests:
            if req.type_url == CLUSTER_TYPE and not req.response_nonce:
                cluster = cluster_pb2.Cluster(name="chat-v1", type=cluster_pb2.Cluster.EDS)
                yield discovery_pb2.DiscoveryResponse(type_url=CLUSTER_TYPE, version_info="c1", nonce="c1",
                                                      resources=[any_pb2.Any(type_url=CLUSTER_TYPE,
                                                                             value=cluster.SerializeToString())])
            elif req.type_url == ENDPOINT_TYPE:
                self.eds_requests.append(req)
                step = next(script, None)
                if step is None:
                    self.done.set()
                    continue
                version, resources = step
                yield discovery_pb2.DiscoveryResponse(type_url=ENDPOINT_TYPE, version_info=version,
                                                      nonce=f"n{version}", resources=resources)


@pytest.fixture()
async def ads():
    server = grpc.aio.server()
    servicer = ScriptedAds()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_eds_bytes_are_acked_when_taken_and_nacked_when_unreadable(ads):
    servicer, address = ads
    seen: list[dict[str, bytes]] = []

    def on_update(clusters, assignments) -> bool:
        try:
            for data in assignments.values():
                assignment_endpoints(data)  # what the picker's view does with them
        except DecodeError:
            return False
        seen.append(dict(assignments))
        return True

    sub = XdsSubscriber(address, "picker-test", on_update)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.wait_for(servicer.done.wait(), 10)
    finally:
        task.cancel()
    replies = [(r.version_info, r.response_nonce, r.error_detail.message) for r in servicer.eds_requests]
    assert replies[0] == ("", "", "")  # the subscription
    assert replies[1] == ("1", "n1", "")  # ACK
    for version, (acked, nonce, error) in zip("234", replies[2:5], strict=True):  # NACK: v1 stays applied
        assert (acked, nonce) == ("1", f"n{version}") and error, replies
    assert "truncated" in replies[2][2] and "type" in replies[3][2] and "view" in replies[4][2]
    assert replies[5] == ("5", "n5", "")
    assert all(isinstance(v, bytes) for v in sub.assignments.values())  # kept as the response's bytes
    assert sub.assignments == {"chat-v1": GOOD_2}
    assert [s.get("chat-v1") for s in seen][-2:] == [GOOD_1, GOOD_2]  # nothing bad ever reached the view
