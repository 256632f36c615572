"""A flood of ADS streams: at most ``max_streams`` are served, the rest refused at once, and a closed
stream frees its slot and its node entry (bounded memory)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from xds_server.ads.server import INBOX_SIZE, AdsServicer, SnapshotCache, start_ads_server
from xds_server.config import parse_config
from xds_server.control import endpoint_specs
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EngineParams, EngineState
from xds_server.resources.build import build_snapshot
from xds_server.snapshot import CLUSTER_TYPE

CFG = parse_config(yaml.safe_dump({"services": [{"name": "chat", "versions": [
    {"name": "v1", "endpoints": [{"address": "10.0.0.1:8000"}]}]}]}))


def cds_request(node: str) -> discovery_pb2.DiscoveryRequest:
    return discovery_pb2.DiscoveryRequest(node=base_pb2.Node(id=node, cluster="c"), type_url=CLUSTER_TYPE)


async def open_stream(stub, node: str):
    """Open a stream, send the CDS request; returns (call, first response or the gRPC error)."""
    queue: asyncio.Queue = asyncio.Queue()
    await queue.put(cds_request(node))

    async def requests():
        while (item := await queue.get()) is not None:
            yield item

    call = stub.StreamAggregatedResources(requests())
    try:
        first = await asyncio.wait_for(call.read(), 5)
    except grpc.aio.AioRpcError as err:
        return call, queue, err
    return call, queue, first


@pytest.fixture
async def ads():
    cache = SnapshotCache()
    weights, _ = compute_weights(endpoint_specs(CFG), {}, EngineState(), EngineParams(), plugins=BUILTIN)
    await cache.set(build_snapshot(CFG, weights, "127.0.0.1:18080"))
    server, servicer, port = await start_ads_server(cache, "127.0.0.1:0", max_streams=4)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def test_streams_past_the_limit_are_refused_and_closed_ones_free_their_slot(ads):
    servicer, stub = ads
    opened = [await open_stream(stub, f"envoy-{i}") for i in range(7)]
    answered = [o for o in opened if isinstance(o[2], discovery_pb2.DiscoveryResponse)]
    refused = [o for o in opened if isinstance(o[2], grpc.aio.AioRpcError)]
    assert len(answered) == 4 and len(refused) == 3
    assert {o[2].code() for o in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "at most 4" in refused[0][2].details()
    assert len(servicer.describe_nodes()) == 4 and servicer.open_streams == 4

    for call, _queue, _ in answered:   # clients go away: slots and node entries are freed
        call.cancel()
    for _ in range(50):
        if servicer.open_streams == 0 and not servicer.describe_nodes():
            break
        await asyncio.sleep(0.05)
    assert servicer.open_streams == 0 and servicer.describe_nodes() == []
    again = [await open_stream(stub, f"again-{i}") for i in range(4)]
    assert all(isinstance(o[2], discovery_pb2.DiscoveryResponse) for o in again)
    for call, _, _ in again:
        call.cancel()


async def test_a_client_that_floods_requests_and_reads_nothing_is_read_only_a_little_ahead():
    """An Envoy (or anyone) that sends requests without reading our answers: the stream reads at most
    INBOX_SIZE requests ahead, then waits (HTTP/2 flow control pushes back on the client), so our
    memory for that stream stays bounded."""
    cache = SnapshotCache()
    weights, _ = compute_weights(endpoint_specs(CFG), {}, EngineState(), EngineParams(), plugins=BUILTIN)
    await cache.set(build_snapshot(CFG, weights, "127.0.0.1:18080"))
    servicer = AdsServicer(cache)
    pulled = 0

    async def flood():
        nonlocal pulled
        for _ in range(10_000):
            pulled += 1
            yield cds_request("flooder")

    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    stream = servicer.StreamAggregatedResources(flood(), Context())
    first = await stream.__anext__()   # the first answer (wire bytes); then the client reads nothing more
    assert discovery_pb2.DiscoveryResponse.FromString(first).type_url == CLUSTER_TYPE
    await asyncio.sleep(0.5)
    assert pulled <= INBOX_SIZE + 3, f"{pulled} requests read ahead of processing"
    await stream.aclose()
