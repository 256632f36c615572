"""Validation before sending: what Envoy would NACK is never sent; the last good resource stays."""

from __future__ import annotations

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import symbol_database

from tests.support.snapshots import make_snapshot
from tests.unit.xds_server.test_sotw import BASE, assignment, cluster, snap
from xds_server.ads.validate import UINT32_MAX, check_assignment, check_route_config, guard
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, ROUTE_TYPE


def cla(*localities: tuple[int, list[int | None], int | None]) -> endpoint_pb2.ClusterLoadAssignment:
    """Localities as ``(priority, endpoint weights (None = unset), locality weight (None = unset))``."""
    out = endpoint_pb2.ClusterLoadAssignment(cluster_name="c")
    for i, (priority, weights, loc_weight) in enumerate(localities):
        loc = out.endpoints.add(priority=priority)
        loc.locality.zone = f"z{i}"
        if loc_weight is not None:
            loc.load_balancing_weight.value = loc_weight
        for j, w in enumerate(weights):
            lb = loc.lb_endpoints.add()
            lb.endpoint.address.socket_address.address = f"10.0.{i}.{j + 1}"
            lb.endpoint.address.socket_address.port_value = 8000
            if w is not None:
                lb.load_balancing_weight.value = w
    return out


def test_a_valid_assignment_has_no_problems():
    assert check_assignment(cla((0, [1, 5, None], None), (1, [2], None))) == []
    assert check_assignment(endpoint_pb2.ClusterLoadAssignment(cluster_name="empty")) == []


@pytest.mark.parametrize(("bad", "needle"), [
    (cla((0, [1, 0], None)), "lb_endpoints[1].load_balancing_weight must be >= 1"),
    (cla((0, [UINT32_MAX, 1], None)), "sum of endpoint weights 4294967296"),
    (cla((0, [1], UINT32_MAX), (0, [1], 1)), "priority 0: sum of locality weights 4294967296"),
    (cla((0, [1], 0)), "endpoints[0].load_balancing_weight must be >= 1"),
    (cla((129, [1], None)), "priority 129 > 128"),
    (cla((0, [1], None), (2, [1], None)), "priorities [0, 2] skip a level"),
    (cla((1, [1], None)), "priorities [1] skip a level"),
])
def test_assignment_rules(bad, needle):
    problems = check_assignment(bad)
    assert any(needle in p for p in problems), problems


def test_unset_endpoint_weights_count_as_one_in_the_sum():
    assert check_assignment(cla((0, [UINT32_MAX - 1, None], None))) == []
    assert check_assignment(cla((0, [UINT32_MAX - 1, None, None], None))) != []


def test_duplicate_virtual_host_names_and_domains_are_refused():
    rc = route_pb2.RouteConfiguration(name="r")
    rc.virtual_hosts.add(name="chat", domains=["*"])
    rc.virtual_hosts.add(name="embed", domains=["*"])
    rc.virtual_hosts.add(name="chat", domains=["x"])
    problems = check_route_config(rc)
    assert any("domain '*'" in p for p in problems) and any("'chat' is used twice" in p for p in problems)


def bad_snapshot(weights: dict, **overrides):
    """``snap(weights)`` with messages replaced: ``{type_url: {name: message}}``."""
    good = snap(weights)
    msgs = {}
    for t in good.resources:
        msgs[t] = {}
        for n, r in good.of(t).items():
            m = symbol_database.Default().GetSymbol(r.packed.TypeName())()
            r.packed.Unpack(m)
            msgs[t][n] = m
    for t, by_name in overrides.items():
        msgs[t].update(by_name)
    return make_snapshot(msgs)


def test_guard_passes_a_valid_snapshot_through_unchanged():
    s0 = snap(BASE)
    served, rejected = guard(s0, None)
    assert served is s0 and rejected == []


def test_guard_keeps_the_last_good_resource_and_reports_the_bad_one():
    s0 = snap(BASE)
    s1 = bad_snapshot({**BASE, "a": [5, 5]}, **{ENDPOINT_TYPE: {"b": assignment("b", [3, 0])}})
    served, [rej] = guard(s1, s0)
    assert (rej.type_url, rej.name, rej.kept) == (ENDPOINT_TYPE, "b", s0.of(ENDPOINT_TYPE)["b"].version)
    assert any("must be >= 1" in p for p in rej.problems)
    assert served.of(ENDPOINT_TYPE)["b"] is s0.of(ENDPOINT_TYPE)["b"]  # last good stays
    assert served.of(ENDPOINT_TYPE)["a"] is s1.of(ENDPOINT_TYPE)["a"]  # the good change goes out
    assert served.versions[ENDPOINT_TYPE] != s0.versions[ENDPOINT_TYPE]


def test_guard_leaves_out_a_bad_resource_that_never_had_a_good_version():
    s1 = bad_snapshot(BASE, **{ENDPOINT_TYPE: {"c": assignment("c", [0])}})
    served, [rej] = guard(s1, None)
    assert rej.kept is None and "c" not in served.of(ENDPOINT_TYPE)


def test_guard_refuses_a_resource_whose_own_name_differs():
    s1 = bad_snapshot(BASE, **{CLUSTER_TYPE: {"a": cluster("not-a")}})
    _, [rej] = guard(s1, None)
    assert rej.type_url == CLUSTER_TYPE and "differs from the resource name 'a'" in rej.problems[0]


def test_guard_refuses_duplicate_domains_in_routes():
    rc = route_pb2.RouteConfiguration(name="inferlb")
    rc.virtual_hosts.add(name="a", domains=["*"])
    rc.virtual_hosts.add(name="b", domains=["*"])
    _, [rej] = guard(bad_snapshot(BASE, **{ROUTE_TYPE: {"inferlb": rc}}), None)
    assert rej.type_url == ROUTE_TYPE
