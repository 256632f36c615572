"""The wire-format assignment (xds_server.resources.endpoints) equals the plain protobuf construction."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.factories import weight
from xds_server.config import split_hostport
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight
from xds_server.resources.endpoints import TIER_PRIORITY, AssignmentLayout, build_assignment

_HEALTH = {HEALTHY: health_check_pb2.HEALTHY, UNHEALTHY: health_check_pb2.UNHEALTHY,
           DRAINING: health_check_pb2.DRAINING}
_NONE = {"max_concurrency": 0, "gpu_class": ""}


def plain(cluster: str, weights: list[EndpointWeight], max_concurrency: Mapping[str, int] | None = None,
          gpu_class: Mapping[str, str] | None = None,
          tier: Mapping[str, str] | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    """The reference: the message built field by field with protobuf (the rules of AssignmentLayout)."""
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    tiers = [TIER_PRIORITY[tier.get(w.address, "edge")] if tier else 0 for w in weights]
    for level, priority in enumerate(sorted(set(tiers))):
        members = [w for w, t in zip(weights, tiers, strict=True) if t == priority]
        own = []
        for w in members:
            fields = {}
            if max_concurrency and w.address in max_concurrency:
                fields["max_concurrency"] = max_concurrency[w.address]
            if gpu_class and w.address in gpu_class:
                fields["gpu_class"] = gpu_class[w.address]
            own.append(fields)
        keys = [tuple(f.items()) for f in own]
        shared = dict(max(set(keys), key=lambda k: (keys.count(k), k)))
        locality = cla.endpoints.add()
        locality.priority = level
        if shared:
            locality.metadata.filter_metadata["inferlb"].update(shared)
        for w, fields in zip(members, own, strict=True):
            host, port = split_hostport(w.address)
            lb = locality.lb_endpoints.add()
            lb.endpoint.address.socket_address.address = host
            lb.endpoint.address.socket_address.port_value = port
            lb.health_status = _HEALTH[w.health]
            lb.load_balancing_weight.value = w.weight
            if fields != shared:
                differs = {k: fields.get(k, _NONE[k]) for k in (*shared, *fields) if fields.get(k) != shared.get(k)}
                meta = base_pb2.Metadata()
                meta.filter_metadata["inferlb"].update(differs)
                lb.metadata.CopyFrom(meta)
    return cla


def encoded(cluster, weights, limits=None, classes=None, tiers=None) -> bytes:
    layout = AssignmentLayout(cluster, [w.address for w in weights], limits, classes, tiers)
    return layout.encode([w.weight for w in weights], [w.health for w in weights])


ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:9000", "[fd00::3]:8001", "a." * 80 + "example.com:65535", "h:0", "10.0.0.9:1"]


@pytest.mark.parametrize("case", [
    dict(),
    dict(limits={a: 16 for a in ADDRESSES}, classes={a: "a100" for a in ADDRESSES}),
    dict(limits={a: i for i, a in enumerate(ADDRESSES)}, classes={ADDRESSES[1]: "a10", ADDRESSES[2]: "h100"}),
    dict(tiers={ADDRESSES[0]: "cloud", ADDRESSES[3]: "cloud"}, limits={ADDRESSES[0]: 3}),
    dict(tiers={a: "cloud" for a in ADDRESSES}),
])
def test_encoding_is_the_deterministic_serialisation_of_the_plain_construction(case):
    ws = [weight("c", a, w, h) for a, w, h in zip(
        ADDRESSES, [1, 127, 128, 300, 2**20, 2**32 - 1], [HEALTHY, UNHEALTHY, DRAINING, HEALTHY, DRAINING, HEALTHY],
        strict=True)]
    args = (case.get("limits"), case.get("classes"), case.get("tiers"))
    want = plain("chat-v1", ws, *args)
    data = encoded("chat-v1", ws, *args)
    assert data == want.SerializeToString(deterministic=True)
    assert build_assignment("chat-v1", ws, *args) == want


def test_no_endpoints_and_no_name():
    assert encoded("c", []) == plain("c", []).SerializeToString(deterministic=True)
    assert encoded("", [weight("", "10.0.0.1:80", 3)]) == plain(
        "", [weight("", "10.0.0.1:80", 3)]).SerializeToString(deterministic=True)


def test_a_layout_encodes_each_round_and_reuses_a_previous_layouts_addresses():
    ws = [weight("c", a, 5) for a in ADDRESSES]
    first = AssignmentLayout("c", ADDRESSES, {a: 4 for a in ADDRESSES})
    second = AssignmentLayout("c", ADDRESSES[1:], {a: 4 for a in ADDRESSES}, previous=first)
    for round_weights in ([3, 1, 9, 4, 4], [200, 7, 7, 1, 65_000]):
        got = second.encode(round_weights, [HEALTHY] * 5)
        want = plain("c", [w._replace(weight=n) for w, n in zip(ws[1:], round_weights, strict=True)],
                     {a: 4 for a in ADDRESSES})
        assert got == want.SerializeToString(deterministic=True)


def test_encode_refuses_a_weight_below_1_and_a_wrong_length():
    layout = AssignmentLayout("c", ADDRESSES[:2])
    with pytest.raises(ValueError, match="10.0.0.2:9000"):
        layout.encode([4, 0], [HEALTHY, HEALTHY])
    with pytest.raises(ValueError, match="2 endpoints"):
        layout.encode([4], [HEALTHY])


endpoint = st.tuples(
    st.sampled_from(["10.0.0.1", "10.1.2.3", "[fd00::1]", "host.example", "x" * 200]),
    st.integers(0, 65_535), st.integers(1, 2**32 - 1), st.sampled_from([HEALTHY, UNHEALTHY, DRAINING]),
    st.none() | st.integers(-3, 5000), st.none() | st.sampled_from(["", "a100", "h100"]),
    st.sampled_from(["edge", "cloud"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(endpoint, max_size=12, unique_by=lambda e: (e[0], e[1])))
def test_generated_assignments_encode_as_protobuf_serialises_them(endpoints):
    ws = [weight("c", f"{h}:{p}", w, health) for h, p, w, health, _, _, _ in endpoints]
    limits = {w.address: e[4] for w, e in zip(ws, endpoints, strict=True) if e[4] is not None}
    classes = {w.address: e[5] for w, e in zip(ws, endpoints, strict=True) if e[5] is not None}
    tiers = {w.address: e[6] for w, e in zip(ws, endpoints, strict=True)}
    assert encoded("c", ws, limits, classes, tiers) == plain("c", ws, limits, classes, tiers).SerializeToString(
        deterministic=True)
