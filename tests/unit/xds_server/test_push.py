"""The shared wire encoding: body once per content, nonce appended per stream, parses as the full response."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from tests.support.factories import request
from tests.unit.xds_server.test_delta import dreq
from tests.unit.xds_server.test_sotw import BASE, snap
from xds_server.ads.delta import DeltaStream
from xds_server.ads.push import WireCache
from xds_server.ads.sotw import SotwStream
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE


def test_wire_bytes_parse_as_the_response_each_stream_would_send():
    s0 = snap(BASE)
    cache = WireCache()
    for _ in range(3):  # three streams: same content, own nonces
        sotw, delta = SotwStream(), DeltaStream()
        sotw.on_request(request(CLUSTER_TYPE))
        sotw.on_request(request(ENDPOINT_TYPE, ["a", "c"]))
        delta.on_request(dreq(CLUSTER_TYPE))
        delta.on_request(dreq(ENDPOINT_TYPE, ["b"]))
        for stream, cls in ((sotw, discovery_pb2.DiscoveryResponse), (delta, discovery_pb2.DeltaDiscoveryResponse)):
            for push in stream.plan(s0):
                assert cls.FromString(cache.encode(push)) == push.message()
    assert len(cache._bodies) == 4  # one body per distinct content, shared by the three streams


def test_the_cache_is_bounded():
    cache = WireCache(size=2)
    for i in range(5):
        stream = SotwStream()
        stream.on_request(request(ENDPOINT_TYPE, ["a"]))
        [push] = stream.plan(snap({**BASE, "a": [i + 1]}))
        cache.encode(push)
    assert len(cache._bodies) == 2
