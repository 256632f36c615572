"""The compiled reader of a ClusterLoadAssignment's endpoints gives what protobuf's reads give."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc import eds_wire

compiled = pytest.mark.skipif(eds_wire._wire is None, reason="ext_proc._wire is not built")


def _normal(localities):
    """Metadata as bytes, so the two readers' results compare with ==."""
    return [(p, m.SerializeToString(deterministic=True) if m is not None else None, names, health, weights,
             [x.SerializeToString(deterministic=True) if x is not None else None for x in metas])
            for p, m, names, health, weights, metas in localities]


def _compiled(cla: endpoint_pb2.ClusterLoadAssignment):
    out = eds_wire._compiled(cla.SerializeToString())
    assert out is not None, "declined"
    return _normal(out)


host = st.sampled_from(["10.0.0.1", "fd00::1", "[fd00::2]", "", "host.example", "é.example", "x" * 300])
lb_endpoint = st.fixed_dictionaries({
    "host": host,
    "port": st.none() | st.integers(0, 2**32 - 1),
    "named_port": st.none() | st.sampled_from(["http", ""]),
    "health": st.sampled_from([0, 1, 2, 3, 4, 5, 99, -7]),
    "weight": st.none() | st.integers(0, 2**32 - 1),
    "meta": st.none() | st.dictionaries(st.sampled_from(["max_concurrency", "gpu_class", "other"]),
                                        st.integers(-5, 100) | st.text(max_size=4), max_size=3),
    "pipe": st.booleans(),
    "name_only": st.booleans(),
    "hostname": st.booleans(),
})
locality = st.fixed_dictionaries({
    "priority": st.integers(0, 2**32 - 1),
    "meta": st.none() | st.dictionaries(st.sampled_from(["max_concurrency", "gpu_class"]),
                                        st.integers(0, 64) | st.text(max_size=4), max_size=2),
    "weight": st.none() | st.integers(1, 100),
    "zone": st.none() | st.sampled_from(["a", "b"]),
    "endpoints": st.lists(lb_endpoint, max_size=6),
})


def build(localities, name="c", policy=False):
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    if policy:
        cla.policy.overprovisioning_factor.value = 140
    for spec in localities:
        loc = cla.endpoints.add()
        loc.priority = spec["priority"]
        if spec["meta"] is not None:
            loc.metadata.filter_metadata["inferlb"].update(spec["meta"])
        if spec["weight"] is not None:
            loc.load_balancing_weight.value = spec["weight"]
        if spec["zone"] is not None:
            loc.locality.zone = spec["zone"]
        for e in spec["endpoints"]:
            lb = loc.lb_endpoints.add()
            if e["name_only"]:
                lb.endpoint_name = "named"
            else:
                sock = lb.endpoint.address.socket_address
                sock.address = e["host"]
                if e["port"] is not None:
                    sock.port_value = e["port"]
                if e["named_port"] is not None:
                    sock.named_port = e["named_port"]
                if e["pipe"]:
                    lb.endpoint.address.pipe.path = "/tmp/sock"
                if e["hostname"]:
                    lb.endpoint.hostname = "h"
            lb.health_status = e["health"]
            if e["weight"] is not None:
                lb.load_balancing_weight.value = e["weight"]
            if e["meta"] is not None:
                lb.metadata.filter_metadata["inferlb"].update(e["meta"])
    return cla


@compiled
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(locality, max_size=4), st.booleans())
def test_compiled_reads_what_protobuf_reads(localities, policy):
    cla = build(localities, policy=policy)
    assert _compiled(cla) == _normal(eds_wire.assignment_endpoints_py(cla))


@compiled
def test_names_health_weights_of_a_plain_assignment():
    cla = build([{"priority": 1, "meta": {"max_concurrency": 8}, "weight": None, "zone": None, "endpoints": [
        {"host": "10.0.0.1", "port": 8000, "named_port": None, "health": health_check_pb2.HEALTHY, "weight": 7,
         "meta": None, "pipe": False, "name_only": False, "hostname": False},
        {"host": "fd00::1", "port": 0, "named_port": None, "health": health_check_pb2.DRAINING, "weight": None,
         "meta": {"gpu_class": "a10"}, "pipe": False, "name_only": False, "hostname": False},
        {"host": "10.0.0.3", "port": None, "named_port": "http", "health": 0, "weight": 2, "meta": None,
         "pipe": False, "name_only": False, "hostname": False},
    ]}])
    ((priority, meta, names, health, weights, metas),) = eds_wire.assignment_endpoints(cla)
    assert (priority, names, health, weights) == (1, ["10.0.0.1:8000", "[fd00::1]:0", None], [1, 3, 0], [7, 0, 2])
    assert meta.filter_metadata["inferlb"]["max_concurrency"] == 8
    assert metas[0] is None and metas[1].filter_metadata["inferlb"]["gpu_class"] == "a10"


@compiled
def test_bytes_that_are_not_an_assignment_are_declined():
    data = build([{"priority": 0, "meta": None, "weight": None, "zone": None, "endpoints": [
        {"host": "10.0.0.1", "port": 8000, "named_port": None, "health": 1, "weight": 7, "meta": None,
         "pipe": False, "name_only": False, "hostname": False}]}]).SerializeToString()
    for bad in (data[:-1], data + b"\x0b", b"\x12\x05\x12\x03\x0a\x01\xff", b"\x13"):
        assert eds_wire._wire.assignment_endpoints(bad) is None
    # the same field twice, which protobuf would merge: left to protobuf
    twice = b"\x12\x0a\x12\x08" + b"\x0a\x02\x0a\x00" + b"\x0a\x02\x0a\x00"
    assert eds_wire._wire.assignment_endpoints(twice) is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(locality, max_size=3), st.booleans(), st.booleans())
def test_the_bytes_read_as_the_message(localities, policy, with_decoder):
    # The snapshot hands the view its serialised assignments; with or without the compiled decoder,
    # they read as the message does (metadata compared through protobuf's own equality).
    cla = build(localities, policy=policy)
    saved = eds_wire._wire
    if not with_decoder:
        eds_wire._wire = None
    try:
        assert eds_wire.assignment_endpoints(cla.SerializeToString()) == eds_wire.assignment_endpoints(cla)
    finally:
        eds_wire._wire = saved


# --- cluster_name: the name alone, from the bytes ------------------------------------------------


@given(name=st.text(max_size=40), localities=st.integers(0, 3), policy=st.booleans(), named=st.booleans())
def test_cluster_name_reads_what_protobuf_reads(name, localities, policy, named):
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    for i in range(localities):
        loc = cla.endpoints.add(priority=i)
        loc.lb_endpoints.add().endpoint.address.socket_address.address = f"10.0.0.{i}"
    if policy:
        cla.policy.overprovisioning_factor.value = 140
    if named:
        cla.named_endpoints["x"].address.socket_address.port_value = 80
    data = cla.SerializeToString()
    assert eds_wire.cluster_name(data) == endpoint_pb2.ClusterLoadAssignment.FromString(data).cluster_name == name


def test_cluster_name_anywhere_and_the_last_one_wins():
    """Serialisers write field 1 first, but a parser must not rely on it; a repeated singular field
    merges to its last value (protobuf's encoding guide)."""
    locality = endpoint_pb2.ClusterLoadAssignment()
    locality.endpoints.add(priority=1)
    data = (locality.SerializeToString() + endpoint_pb2.ClusterLoadAssignment(cluster_name="a").SerializeToString()
            + endpoint_pb2.ClusterLoadAssignment(cluster_name="b").SerializeToString())
    assert endpoint_pb2.ClusterLoadAssignment.FromString(data).cluster_name == "b"
    assert eds_wire.cluster_name(data) == "b"
    assert eds_wire.cluster_name(b"") == ""


@pytest.mark.parametrize("data", [
    b"\x0a\x05abc",        # the name's length runs past the end
    b"\x0a",               # a key without its length
    b"\x0b\x00",           # wire type 3 (groups) at the top level
    b"\x0a\x02\xff\xfe",   # a name that is not UTF-8
    b"\x08" + b"\xff" * 11,  # an overlong varint
    b"\x00\x01",           # field number 0
])
def test_cluster_name_refuses_malformed_bytes(data):
    from google.protobuf.message import DecodeError
    with pytest.raises(DecodeError):
        eds_wire.cluster_name(data)
