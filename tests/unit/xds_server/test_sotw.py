"""The per-stream State-of-the-World protocol state machine (no I/O): what to send, when, and why."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2

from tests.support.ads import pending
from tests.support.factories import request
from tests.support.snapshots import make_snapshot
from xds_server.ads.common import NACK_DETAIL_CHARS
from xds_server.ads.sotw import SotwStream
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE

CDS, EDS, LDS, RDS = CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE


def cluster(name: str, timeout_ms: int = 1000) -> cluster_pb2.Cluster:
    c = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
    c.connect_timeout.FromMilliseconds(timeout_ms)
    c.eds_cluster_config.eds_config.ads.SetInParent()
    return c


def assignment(name: str, weights: list[int]) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    loc = cla.endpoints.add()
    for i, w in enumerate(weights):
        lb = loc.lb_endpoints.add()
        lb.endpoint.address.socket_address.address = f"10.0.0.{i + 1}"
        lb.endpoint.address.socket_address.port_value = 8000
        lb.load_balancing_weight.value = w
    return cla


def snap(weights: dict[str, list[int]], timeouts: dict[str, int] | None = None, listener_port: int = 10000,
         route_cluster: str | None = None):
    """Clusters and assignments named like ``weights``; optional per-cluster connect timeouts (ms) and
    a route to ``route_cluster``."""
    timeouts = timeouts or {}
    lst = listener_pb2.Listener(name="inferlb")
    lst.address.socket_address.port_value = listener_port
    rc = route_pb2.RouteConfiguration(name="inferlb")
    if route_cluster:
        rc.virtual_hosts.add(name="x", domains=["*"]).routes.add().route.cluster = route_cluster
    return make_snapshot({
        CDS: {n: cluster(n, timeouts.get(n, 1000)) for n in weights},
        EDS: {n: assignment(n, w) for n, w in weights.items()},
        LDS: {"inferlb": lst},
        RDS: {"inferlb": rc},
    })


BASE = {"a": [1, 2], "b": [3, 4], "c": [5]}


def names_in(resp) -> list[str]:
    out = []
    for any_msg in resp.resources:
        if resp.type_url == CDS:
            msg = cluster_pb2.Cluster()
        elif resp.type_url == EDS:
            msg = endpoint_pb2.ClusterLoadAssignment()
        elif resp.type_url == LDS:
            msg = listener_pb2.Listener()
        else:
            msg = route_pb2.RouteConfiguration()
        assert any_msg.Unpack(msg)
        out.append(msg.cluster_name if resp.type_url == EDS else msg.name)
    return out


def ack(stream: SotwStream, resp, names=()) -> str:
    return stream.on_request(request(resp.type_url, names, nonce=resp.nonce, version_info=resp.version_info))


def connected(s0, eds_names=("a", "b", "c")) -> tuple[SotwStream, list]:
    """A stream that subscribed to CDS (wildcard) and EDS ``eds_names`` and ACKed everything."""
    stream = SotwStream()
    assert stream.on_request(request(CDS)) == "initial"
    [cds] = pending(stream, s0)
    assert ack(stream, cds) == "ack"
    assert stream.on_request(request(EDS, eds_names)) == "initial"
    [eds] = pending(stream, s0)
    assert ack(stream, eds, eds_names) == "ack"
    assert pending(stream, s0) == []
    return stream, [cds, eds]


# --- first requests -------------------------------------------------------------------------------


def test_nothing_is_sent_before_a_request_or_without_a_snapshot():
    stream = SotwStream()
    assert pending(stream, snap(BASE)) == []
    stream.on_request(request(CDS))
    assert pending(stream, None) == []


def test_initial_cds_request_is_wildcard_and_gets_every_cluster():
    s0 = snap(BASE)
    stream = SotwStream()
    assert stream.on_request(request(CDS)) == "initial"
    [resp] = pending(stream, s0)
    assert resp.type_url == CDS
    assert sorted(names_in(resp)) == ["a", "b", "c"]
    assert resp.version_info == s0.versions[CDS]
    assert resp.nonce
    assert pending(stream, s0) == []  # sent once


def test_cds_star_is_also_wildcard():
    stream = SotwStream()
    stream.on_request(request(CDS, ["*"]))
    [resp] = pending(stream, snap(BASE))
    assert sorted(names_in(resp)) == ["a", "b", "c"]


def test_eds_request_gets_only_the_named_assignments():
    s0 = snap(BASE)
    stream = SotwStream()
    assert stream.on_request(request(EDS, ["b"])) == "initial"
    [resp] = pending(stream, s0)
    assert resp.type_url == EDS
    assert names_in(resp) == ["b"]
    assert resp.version_info == s0.versions[EDS]


def test_eds_request_for_an_unknown_name_sends_nothing_for_it():
    stream = SotwStream()
    stream.on_request(request(EDS, ["zzz"]))
    assert pending(stream, snap(BASE)) == []
    stream.on_request(request(EDS, ["zzz", "a"]))  # still no nonce sent: a fresh "initial"
    [resp] = pending(stream, snap(BASE))
    assert names_in(resp) == ["a"]


def test_empty_eds_subscription_is_not_a_wildcard():
    stream = SotwStream()
    stream.on_request(request(EDS, []))
    assert pending(stream, snap(BASE)) == []


def test_lds_is_wildcard_and_rds_is_named():
    s0 = snap(BASE)
    stream = SotwStream()
    stream.on_request(request(LDS))
    stream.on_request(request(RDS, ["inferlb"]))
    resps = pending(stream, s0)
    assert [r.type_url for r in resps] == [LDS, RDS]
    assert names_in(resps[0]) == ["inferlb"] and names_in(resps[1]) == ["inferlb"]


def test_responses_come_in_cds_eds_lds_rds_order():
    s0 = snap(BASE)
    stream = SotwStream()
    for t, names in ((RDS, ["inferlb"]), (LDS, []), (EDS, ["a"]), (CDS, [])):  # requested in reverse
        stream.on_request(request(t, names))
    assert [r.type_url for r in pending(stream, s0)] == [CDS, EDS, LDS, RDS]


# --- ACK / NACK / stale ---------------------------------------------------------------------------


def test_ack_nack_and_stale_classification():
    s0, s1 = snap(BASE), snap({**BASE, "a": [9, 9]})
    stream = SotwStream()
    assert stream.on_request(request(EDS, ["a"])) == "initial"
    [r0] = pending(stream, s0)
    assert ack(stream, r0, ["a"]) == "ack"
    st = stream.types[EDS]
    assert st.acked == s0.versions[EDS] and st.acks == 1
    [r1] = pending(stream, s1)
    # a request still carrying the previous nonce is stale
    assert ack(stream, r0, ["a"]) == "stale"
    assert stream.on_request(request(EDS, ["a"], nonce="999")) == "stale"
    assert st.acks == 1 and st.acked == s0.versions[EDS]
    nack = request(EDS, ["a"], nonce=r1.nonce, version_info=s0.versions[EDS], error="x" * 1000 + "THE REASON")
    assert stream.on_request(nack) == "nack"
    assert st.nacks == 1
    assert st.nack.endswith("THE REASON") and len(st.nack) == NACK_DETAIL_CHARS
    assert st.acked == s0.versions[EDS]  # a NACK does not move the applied version


def test_stale_request_changes_nothing():
    s0 = snap(BASE)
    stream = SotwStream()
    stream.on_request(request(EDS, ["a"]))
    [r0] = pending(stream, s0)
    ack(stream, r0, ["a"])
    assert stream.on_request(request(EDS, ["a", "b"], nonce="not-the-latest")) == "stale"
    assert pending(stream, s0) == []  # "b" was not subscribed by the stale request


def test_nonce_for_a_type_never_answered_is_stale():
    stream = SotwStream()
    assert stream.on_request(request(CDS, nonce="1")) == "stale"
    assert pending(stream, snap(BASE)) == []


def test_nonces_are_per_type_latest():
    s0 = snap(BASE)
    stream = SotwStream()
    stream.on_request(request(CDS))
    stream.on_request(request(EDS, ["a"]))
    cds, eds = pending(stream, s0)
    # the EDS nonce is not valid for CDS and vice versa
    assert stream.on_request(request(CDS, nonce=eds.nonce)) == "stale"
    assert stream.on_request(request(EDS, ["a"], nonce=cds.nonce)) == "stale"
    assert ack(stream, cds) == "ack"
    assert ack(stream, eds, ["a"]) == "ack"


# --- C03: a NACKed version is not re-sent in a loop -------------------------------------------------


def test_after_a_cds_nack_the_same_version_is_not_resent_but_a_change_is():
    s0, s1, s2 = snap(BASE), snap(BASE, {"a": 5}), snap(BASE, {"a": 7})
    stream, _ = connected(s0)
    [cds1, eds_rewarm] = pending(stream, s1)
    assert cds1.type_url == CDS and eds_rewarm.type_url == EDS
    nack = request(CDS, nonce=cds1.nonce, version_info=s0.versions[CDS], error="rejected")
    assert stream.on_request(nack) == "nack"
    ack(stream, eds_rewarm, ["a", "b", "c"])
    for _ in range(3):
        assert pending(stream, s1) == []
    [cds2, _eds] = pending(stream, s2)
    assert cds2.type_url == CDS and cds2.version_info == s2.versions[CDS]


def test_after_an_eds_nack_the_same_version_is_not_resent_but_a_change_is():
    s0, s1, s2 = snap(BASE), snap({**BASE, "b": [0, 4]}), snap({**BASE, "b": [2, 4]})
    stream, _ = connected(s0)
    [bad] = pending(stream, s1)
    assert names_in(bad) == ["b"]
    nack = request(EDS, ["c", "a", "b"], nonce=bad.nonce, version_info=s0.versions[EDS],
                   error="LoadBalancingWeight: value must be greater than or equal to 1")
    assert stream.on_request(nack) == "nack"
    assert pending(stream, s1) == []
    assert pending(stream, s1) == []
    [fixed] = pending(stream, s2)
    assert names_in(fixed) == ["b"]


def test_reverting_to_the_last_good_version_after_a_nack_is_sent():
    s0, s1 = snap(BASE), snap({**BASE, "a": [0]})
    stream, _ = connected(s0)
    [bad] = pending(stream, s1)
    stream.on_request(request(EDS, ["a", "b", "c"], nonce=bad.nonce, version_info=s0.versions[EDS], error="no"))
    [again] = pending(stream, s0)
    assert names_in(again) == ["a"]


# --- only what changed ----------------------------------------------------------------------------


def test_weight_change_resends_only_that_clusters_assignment():
    s0, s1 = snap(BASE), snap({**BASE, "b": [3, 40]})
    stream, _ = connected(s0)
    resps = pending(stream, s1)
    assert [r.type_url for r in resps] == [EDS]  # no CDS: the clusters did not change
    assert names_in(resps[0]) == ["b"]
    assert resps[0].version_info == s1.versions[EDS]
    cla = endpoint_pb2.ClusterLoadAssignment()
    resps[0].resources[0].Unpack(cla)
    assert [e.load_balancing_weight.value for e in cla.endpoints[0].lb_endpoints] == [3, 40]


def test_cds_change_resends_its_assignment_in_the_same_pending_call():
    """C01: Envoy re-warms a changed cluster and its EDS re-request looks like an ACK."""
    s0, s1 = snap(BASE), snap(BASE, {"b": 2500})
    assert s1.of(EDS)["b"].version == s0.of(EDS)["b"].version  # the assignment did not change
    stream, _ = connected(s0)
    resps = pending(stream, s1)
    assert [r.type_url for r in resps] == [CDS, EDS]
    assert sorted(names_in(resps[0])) == ["a", "b", "c"]  # CDS is state of the world
    assert names_in(resps[1]) == ["b"]  # only the changed cluster's assignment
    # Envoy's re-request after the CDS change is a plain ACK: nothing more to send
    ack(stream, resps[0])
    ack(stream, resps[1], ["a", "b", "c"])
    assert pending(stream, s1) == []


def test_cds_change_rewarms_only_subscribed_clusters_and_only_once():
    s0, s1 = snap(BASE), snap(BASE, {"a": 10, "c": 10})
    stream, _ = connected(s0, eds_names=("a", "b"))
    cds, eds = pending(stream, s1)
    assert names_in(eds) == ["a"]  # "c" is not subscribed over EDS
    ack(stream, cds)
    ack(stream, eds, ["a", "b"])
    stream.on_request(request(EDS, ["a", "b", "c"], nonce=eds.nonce, version_info=eds.version_info))
    [eds2] = pending(stream, s1)
    assert names_in(eds2) == ["c"]  # newly subscribed: sent once, "a" not again


def test_new_cluster_is_not_a_rewarm_but_is_sent_when_subscribed():
    s0, s1 = snap(BASE), snap({**BASE, "d": [7]})
    stream, _ = connected(s0)
    [cds] = pending(stream, s1)  # the assignment of "d" waits for Envoy to ask for it
    assert cds.type_url == CDS and "d" in names_in(cds)
    stream.on_request(request(EDS, ["a", "b", "c", "d"], nonce=stream.types[EDS].nonce,
                              version_info=s0.versions[EDS]))
    [eds] = pending(stream, s1)
    assert names_in(eds) == ["d"]


def test_reordered_names_do_not_trigger_a_resend():
    s0 = snap(BASE)
    stream, (_, eds) = connected(s0)
    assert stream.on_request(request(EDS, ["c", "a", "b"], nonce=eds.nonce, version_info=eds.version_info)) == "ack"
    assert pending(stream, s0) == []
    assert stream.on_request(request(EDS, ["b", "c", "a", "a"], nonce=eds.nonce, version_info=eds.version_info)) \
        == "ack"
    assert pending(stream, s0) == []


def test_name_dropped_and_readded_is_sent_again():
    """C15: a cluster removed and added back gets its endpoints again."""
    s0 = snap(BASE)
    stream, (_, eds) = connected(s0)
    assert stream.on_request(request(EDS, ["a", "c"], nonce=eds.nonce, version_info=eds.version_info)) == "ack"
    assert pending(stream, s0) == []
    assert stream.on_request(request(EDS, ["a", "b", "c"], nonce=eds.nonce, version_info=eds.version_info)) == "ack"
    [again] = pending(stream, s0)
    assert names_in(again) == ["b"]


def test_service_removed_then_added_back_over_cds_and_eds():
    """C15 end to end: CDS drops a cluster, Envoy unsubscribes, CDS adds it back, Envoy re-subscribes."""
    with_b, without_b = snap(BASE), snap({"a": BASE["a"], "c": BASE["c"]})
    stream, (cds, eds) = connected(with_b)
    [cds1] = pending(stream, without_b)
    assert sorted(names_in(cds1)) == ["a", "c"]
    ack(stream, cds1)
    stream.on_request(request(EDS, ["a", "c"], nonce=eds.nonce, version_info=eds.version_info))
    assert pending(stream, without_b) == []
    [cds2] = pending(stream, with_b)
    assert sorted(names_in(cds2)) == ["a", "b", "c"]
    ack(stream, cds2)
    stream.on_request(request(EDS, ["c", "b", "a"], nonce=eds.nonce, version_info=eds.version_info))
    [eds2] = pending(stream, with_b)
    assert names_in(eds2) == ["b"]


def test_listener_change_sends_lds_only():
    s0, s1 = snap(BASE), snap(BASE, listener_port=10001)
    stream = SotwStream()
    for t, names in ((CDS, []), (EDS, ["a", "b", "c"]), (LDS, []), (RDS, ["inferlb"])):
        stream.on_request(request(t, names))
    first = pending(stream, s0)
    for r in first:
        ack(stream, r, ["a", "b", "c"] if r.type_url == EDS else ["inferlb"] if r.type_url == RDS else [])
    assert [r.type_url for r in pending(stream, s1)] == [LDS]


# --- nonces ---------------------------------------------------------------------------------------


def test_nonces_increase_and_are_unique_across_types():
    snaps = [snap(BASE), snap({**BASE, "a": [2, 2]}), snap({**BASE, "a": [2, 2]}, {"b": 3000}),
             snap({**BASE, "a": [3, 3]}, {"b": 3000, "c": 50}, listener_port=10002)]
    stream = SotwStream()
    for t, names in ((CDS, []), (EDS, ["a", "b", "c"]), (LDS, []), (RDS, ["inferlb"])):
        stream.on_request(request(t, names))
    nonces = []
    for s in snaps:
        for r in pending(stream, s):
            nonces.append(r.nonce)
            ack(stream, r, ["a", "b", "c"] if r.type_url == EDS else ["inferlb"] if r.type_url == RDS else [])
    assert len(nonces) >= 8
    assert len(set(nonces)) == len(nonces)
    as_int = [int(n) for n in nonces]
    assert as_int == sorted(as_int)
    assert all(n for n in nonces)


def test_two_streams_keep_separate_state():
    s0 = snap(BASE)
    one, two = SotwStream(), SotwStream()
    one.on_request(request(CDS))
    [r] = pending(one, s0)
    ack(one, r)
    two.on_request(request(CDS))
    [r2] = pending(two, s0)
    assert sorted(names_in(r2)) == ["a", "b", "c"]


# --- make-before-break ----------------------------------------------------------------------------


def test_a_dropped_cluster_stays_in_cds_until_the_routes_that_used_it_are_acked():
    s0 = snap(BASE, route_cluster="b")
    s1 = snap({"a": BASE["a"], "c": BASE["c"]}, route_cluster="a")
    stream = SotwStream()
    for t, names in ((CDS, []), (EDS, ["a", "b", "c"]), (LDS, []), (RDS, ["inferlb"])):
        stream.on_request(request(t, names))
    for r in pending(stream, s0):
        ack(stream, r, ["a", "b", "c"] if r.type_url == EDS else ["inferlb"] if r.type_url == RDS else [])
    resps = pending(stream, s1)
    assert [r.type_url for r in resps] == [CDS, RDS]
    assert sorted(names_in(resps[0])) == ["a", "b", "c"]  # "b" held while the old route may use it
    assert resps[0].version_info != s1.versions[CDS]
    assert pending(stream, s1) == []
    ack(stream, resps[0])
    assert pending(stream, s1) == []  # routes not ACKed yet
    ack(stream, resps[1], ["inferlb"])
    [cds] = pending(stream, s1)
    assert sorted(names_in(cds)) == ["a", "c"] and cds.version_info == s1.versions[CDS]
