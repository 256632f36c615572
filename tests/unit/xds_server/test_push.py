"""The shared wire encoding: body once per content; streams in step share nonce and bytes; the
result parses as the response each stream would send, and each stream's nonces stay its own."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from tests.support.factories import request
from tests.unit.xds_server.test_delta import dreq
from tests.unit.xds_server.test_sotw import BASE, snap
from xds_server.ads.delta import DeltaStream
from xds_server.ads.push import WireCache
from xds_server.ads.sotw import SotwStream
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE

KIND = {"sotw": discovery_pb2.DiscoveryResponse, "delta": discovery_pb2.DeltaDiscoveryResponse}


def streams(nonces: WireCache | None) -> tuple[SotwStream, DeltaStream]:
    """A SotW and a delta stream, each subscribed to CDS and some EDS names."""
    sotw, delta = SotwStream(nonces), DeltaStream(nonces)
    sotw.on_request(request(CLUSTER_TYPE))
    sotw.on_request(request(ENDPOINT_TYPE, ["a", "c"]))
    delta.on_request(dreq(CLUSTER_TYPE))
    delta.on_request(dreq(ENDPOINT_TYPE, ["b"]))
    return sotw, delta


def test_wire_bytes_parse_as_the_response_each_stream_would_send():
    s0 = snap(BASE)
    for shared in (False, True):
        cache = WireCache()
        for _ in range(3):  # three streams: same content
            for stream in streams(cache if shared else None):
                for push in stream.plan(s0):
                    assert KIND[push.protocol].FromString(cache.encode(push)) == push.message()
        assert len(cache._entries) == 4  # one entry per distinct content, shared by the three streams


def test_streams_in_step_send_one_bytes_object_with_one_nonce():
    s0, s1 = snap(BASE), snap({**BASE, "a": [7, 8], "b": [9]})
    cache = WireCache()
    group = [streams(cache) for _ in range(3)]
    for s in (s0, s1):
        for i in (0, 1):  # sotw, delta
            sent = [[(p.nonce, cache.encode(p)) for p in pair[i].plan(s)] for pair in group]
            assert sent[0]
            for other in sent[1:]:
                assert [n for n, _ in other] == [n for n, _ in sent[0]]
                assert all(a is b for (_, a), (_, b) in zip(other, sent[0], strict=True))


def test_a_stream_sending_the_same_content_again_gets_a_new_nonce_and_the_others_follow():
    s0 = snap(BASE)
    cache = WireCache()
    first, second = SotwStream(cache), SotwStream(cache)
    for st in (first, second):
        st.on_request(request(ENDPOINT_TYPE, ["a"]))
    [p1] = first.plan(s0)
    # the subscription goes and comes back: the same content again on the same stream
    first.on_request(request(ENDPOINT_TYPE, [], nonce=p1.nonce, version_info=s0.versions[ENDPOINT_TYPE]))
    first.on_request(request(ENDPOINT_TYPE, ["a"], nonce=p1.nonce))
    [p2] = first.plan(s0)
    assert p2.key == p1.key and int(p2.nonce) > int(p1.nonce)
    [q] = second.plan(s0)
    assert q.nonce == p2.nonce and cache.encode(q) is cache.encode(p2)
    # the first push's bytes still carry its own nonce (the body plus that nonce)
    assert discovery_pb2.DiscoveryResponse.FromString(cache.encode(p1)).nonce == p1.nonce
    # and the stream's nonce rules are unchanged: the older nonce is stale, the newer ACKs
    v = s0.versions[ENDPOINT_TYPE]
    assert first.on_request(request(ENDPOINT_TYPE, ["a"], nonce=p1.nonce, version_info=v)) == "stale"
    assert first.on_request(request(ENDPOINT_TYPE, ["a"], nonce=p2.nonce, version_info=v)) == "ack"


def test_a_stream_ahead_of_the_shared_nonce_gets_a_larger_one():
    s0 = snap(BASE)
    cache = WireCache()
    behind, ahead = SotwStream(cache), SotwStream(cache)
    behind.on_request(request(ENDPOINT_TYPE, ["a"]))
    [p_behind] = behind.plan(s0)
    ahead.on_request(request(CLUSTER_TYPE))  # its CDS response takes a nonce after behind's EDS one
    [cds] = ahead.plan(s0)
    ahead.on_request(request(ENDPOINT_TYPE, ["a"]))
    [p_ahead] = ahead.plan(s0)
    assert int(p_behind.nonce) < int(cds.nonce) < int(p_ahead.nonce)
    for p in (p_behind, p_ahead):
        assert discovery_pb2.DiscoveryResponse.FromString(cache.encode(p)) == p.message()


def test_delta_nonces_stay_pending_per_stream():
    s0 = snap(BASE)
    cache = WireCache()
    one, two = DeltaStream(cache), DeltaStream(cache)
    pushes = []
    for st in (one, two):
        st.on_request(dreq(ENDPOINT_TYPE, ["b"]))
        [p] = st.plan(s0)
        pushes.append(p)
    assert pushes[0].nonce == pushes[1].nonce
    assert one.on_request(dreq(ENDPOINT_TYPE, nonce=pushes[0].nonce)) == "ack"
    assert one.on_request(dreq(ENDPOINT_TYPE, nonce=pushes[0].nonce)) == "stale"  # answered already
    assert two.types[ENDPOINT_TYPE].pending_nonces() == [pushes[1].nonce]


def test_the_cache_is_bounded():
    cache = WireCache(size=2)
    for i in range(5):
        for nonces in (None, cache):  # entries made by encode, and by nonce
            stream = SotwStream(nonces)
            stream.on_request(request(ENDPOINT_TYPE, ["a"]))
            [push] = stream.plan(snap({**BASE, "a": [i + 1]}))
            cache.encode(push)
            assert len(cache._entries) <= 2
    assert len(cache._entries) == 2
