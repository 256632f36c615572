"""The per-stream delta (incremental) ADS state machine (no I/O): what to send, when, and why."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from tests.support.ads import pending
from tests.support.snapshots import make_snapshot
from tests.unit.xds_server.test_sotw import BASE, assignment, cluster, snap
from xds_server.ads.delta import DeltaStream
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE

CDS, EDS, LDS, RDS = CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE


def dreq(type_url: str, subscribe=(), unsubscribe=(), *, nonce: str = "", initial: dict | None = None,
         error: str | None = None) -> discovery_pb2.DeltaDiscoveryRequest:
    """A DeltaDiscoveryRequest as Envoy sends it (``error`` makes it a NACK)."""
    req = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, resource_names_subscribe=list(subscribe), resource_names_unsubscribe=list(unsubscribe),
        response_nonce=nonce, initial_resource_versions=initial or {})
    req.node.id = "envoy-test"
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return req


def names(resp) -> list[str]:
    return sorted(r.name for r in resp.resources)


def ack(stream: DeltaStream, resp) -> str:
    return stream.on_request(dreq(resp.type_url, nonce=resp.nonce))


def connected(s0, eds_names=("a", "b", "c"), routing: bool = False) -> DeltaStream:
    """A delta stream with CDS (wildcard) and EDS ``eds_names`` (and LDS/RDS) subscribed and ACKed."""
    stream = DeltaStream()
    assert stream.on_request(dreq(CDS)) == "initial"
    assert stream.on_request(dreq(EDS, eds_names)) == "initial"
    if routing:
        stream.on_request(dreq(LDS))
        stream.on_request(dreq(RDS, ["inferlb"]))
    for resp in pending(stream, s0):
        assert ack(stream, resp) == "ack"
    assert pending(stream, s0) == []
    return stream


# --- subscriptions --------------------------------------------------------------------------------


def test_empty_first_cds_request_is_wildcard_and_gets_every_cluster():
    s0 = snap(BASE)
    stream = DeltaStream()
    assert stream.on_request(dreq(CDS)) == "initial"
    [resp] = pending(stream, s0)
    assert resp.type_url == CDS and names(resp) == ["a", "b", "c"]
    assert resp.system_version_info == s0.versions[CDS]
    assert {r.name: r.version for r in resp.resources} == {n: r.version for n, r in s0.of(CDS).items()}
    assert list(resp.removed_resources) == []
    assert pending(stream, s0) == []


def test_explicit_star_is_wildcard_and_unsubscribing_it_ends_it():
    s0, s1 = snap(BASE), snap({**BASE, "d": [1]})
    stream = DeltaStream()
    stream.on_request(dreq(CDS, ["*"]))
    [resp] = pending(stream, s0)
    assert names(resp) == ["a", "b", "c"]
    ack(stream, resp)
    stream.on_request(dreq(CDS, ["a"], ["*"]))
    assert pending(stream, s1) == []  # "d" is new but the client now wants only "a"


def test_empty_first_eds_request_is_not_wildcard():
    stream = DeltaStream()
    stream.on_request(dreq(EDS))
    assert pending(stream, snap(BASE)) == []
    stream.on_request(dreq(EDS, ["b"]))
    [resp] = pending(stream, snap(BASE))
    assert names(resp) == ["b"]


def test_lds_is_wildcard_and_rds_is_named_in_push_order():
    s0 = snap(BASE)
    stream = DeltaStream()
    for t, subscribe in ((RDS, ["inferlb"]), (LDS, []), (EDS, ["a"]), (CDS, [])):
        stream.on_request(dreq(t, subscribe))
    assert [r.type_url for r in pending(stream, s0)] == [CDS, EDS, LDS, RDS]


def test_an_empty_cluster_gets_an_empty_assignment_at_once():
    s0 = make_snapshot({CDS: {"e": cluster("e")}, EDS: {"e": assignment("e", [])}})
    stream = DeltaStream()
    stream.on_request(dreq(EDS, ["e"]))
    [resp] = pending(stream, s0)
    assert names(resp) == ["e"]


# --- only what changed ----------------------------------------------------------------------------


def test_weight_change_sends_only_that_assignment():
    s0, s1 = snap(BASE), snap({**BASE, "b": [3, 40]})
    stream = connected(s0)
    [resp] = pending(stream, s1)
    assert resp.type_url == EDS and names(resp) == ["b"]


def test_cds_change_sends_that_cluster_and_its_assignment_without_a_request():
    """C01: in delta Envoy sends no EDS request after re-warming a changed cluster."""
    s0, s1 = snap(BASE), snap(BASE, {"b": 2500})
    stream = connected(s0)
    cds, eds = pending(stream, s1)
    assert cds.type_url == CDS and names(cds) == ["b"]  # only the changed cluster, not the world
    assert eds.type_url == EDS and names(eds) == ["b"]
    ack(stream, cds)
    ack(stream, eds)
    assert pending(stream, s1) == []


def test_removed_cluster_is_in_removed_resources_and_comes_back_with_its_assignment():
    """C15: removed, Envoy unsubscribes its EDS; added back, Envoy subscribes and gets it."""
    with_b, without_b = snap(BASE), snap({"a": BASE["a"], "c": BASE["c"]})
    stream = connected(with_b)
    [cds] = pending(stream, without_b)
    assert names(cds) == [] and list(cds.removed_resources) == ["b"]
    ack(stream, cds)
    assert stream.on_request(dreq(EDS, unsubscribe=["b"])) == "subscribe"
    assert pending(stream, without_b) == []
    [cds2] = pending(stream, with_b)
    assert names(cds2) == ["b"]
    ack(stream, cds2)
    stream.on_request(dreq(EDS, ["b"]))
    [eds] = pending(stream, with_b)
    assert names(eds) == ["b"]


def test_resubscribing_a_known_name_sends_it_again():
    s0 = snap(BASE)
    stream = connected(s0)
    stream.on_request(dreq(EDS, ["a"]))  # already subscribed and known: no change
    assert pending(stream, s0) == []
    stream.on_request(dreq(EDS, unsubscribe=["a"]))
    stream.on_request(dreq(EDS, ["a"]))
    [resp] = pending(stream, s0)
    assert names(resp) == ["a"]


# --- ACK / NACK / nonces --------------------------------------------------------------------------


def test_every_response_has_its_own_nonce_and_acks_name_them():
    s0, s1 = snap(BASE), snap({**BASE, "a": [7]})
    stream = DeltaStream()
    stream.on_request(dreq(EDS, ["a", "b"]))
    [r0] = pending(stream, s0)
    [r1] = pending(stream, s1)  # a second response before the first is ACKed
    st = stream.types[EDS]
    assert r0.nonce != r1.nonce and st.pending_nonces() == [r0.nonce, r1.nonce]
    assert ack(stream, r0) == "ack" and st.acked == s0.versions[EDS]
    assert ack(stream, r1) == "ack" and st.acked == s1.versions[EDS]
    assert st.pending_nonces() == []
    assert ack(stream, r1) == "stale"  # answered already
    assert stream.on_request(dreq(EDS, nonce="999")) == "stale"
    assert st.acks == 2


def test_subscription_change_in_a_stale_request_still_applies():
    stream = DeltaStream()
    assert stream.on_request(dreq(EDS, ["c"], nonce="not-ours")) == "stale"
    [resp] = pending(stream, snap(BASE))
    assert names(resp) == ["c"]


def test_nacked_versions_are_not_resent_but_the_next_change_is():
    """C03."""
    s0, s1, s2 = snap(BASE), snap({**BASE, "b": [0, 4]}), snap({**BASE, "b": [2, 4]})
    stream = connected(s0)
    [bad] = pending(stream, s1)
    reason = "x" * 1000 + "LoadBalancingWeight: value must be greater than or equal to 1"
    assert stream.on_request(dreq(EDS, nonce=bad.nonce, error=reason)) == "nack"
    st = stream.types[EDS]
    assert st.nacks == 1 and st.nack.endswith("greater than or equal to 1") and st.acked == s0.versions[EDS]
    assert pending(stream, s1) == []
    [fixed] = pending(stream, s2)
    assert names(fixed) == ["b"]


# --- reconnect: initial_resource_versions ---------------------------------------------------------


def test_reconnect_with_the_same_versions_sends_nothing():
    s0 = snap(BASE)
    cds_v = {n: r.version for n, r in s0.of(CDS).items()}
    eds_v = {n: r.version for n, r in s0.of(EDS).items()}
    stream = DeltaStream()
    stream.on_request(dreq(CDS, initial=cds_v))
    stream.on_request(dreq(EDS, ["a", "b", "c"], initial=eds_v))
    assert pending(stream, s0) == []


def test_reconnect_sends_what_changed_and_removes_what_is_gone():
    s0 = snap(BASE)
    stream = DeltaStream()
    stream.on_request(dreq(CDS, initial={"a": s0.of(CDS)["a"].version, "b": "old", "zombie": "1"}))
    [resp] = pending(stream, s0)
    assert names(resp) == ["b", "c"]
    assert list(resp.removed_resources) == ["zombie"]


def test_reconnect_rewarms_the_assignment_of_a_changed_cluster_even_if_eds_reports_it_current():
    """After a control-plane restart with a changed cluster, Envoy's EDS request (sent after the CDS
    answer) still reports the assignment's version: it must be sent anyway, or the cluster warms 15 s."""
    s0, s1 = snap(BASE), snap(BASE, {"b": 2500})
    stream = DeltaStream()
    stream.on_request(dreq(CDS, initial={n: r.version for n, r in s0.of(CDS).items()}))
    [cds] = pending(stream, s1)
    assert names(cds) == ["b"]
    stream.on_request(dreq(EDS, ["a", "b", "c"], initial={n: r.version for n, r in s0.of(EDS).items()}))
    [eds] = pending(stream, s1)
    assert names(eds) == ["b"]
    assert pending(stream, s1) == []


# --- make-before-break ----------------------------------------------------------------------------


def test_a_cluster_is_removed_only_after_the_routes_that_used_it_are_acked():
    s0 = snap(BASE, route_cluster="b")
    s1 = snap({"a": BASE["a"], "c": BASE["c"]}, route_cluster="a")
    stream = connected(s0, routing=True)
    resps = pending(stream, s1)
    assert [r.type_url for r in resps] == [RDS]  # the route moves off "b" first; "b" stays
    assert pending(stream, s1) == []
    ack(stream, resps[0])
    [cds] = pending(stream, s1)
    assert cds.type_url == CDS and list(cds.removed_resources) == ["b"]
