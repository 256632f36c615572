"""Edge -> cloud tiers in the picker: the view's two levels, the spill rule, and pick() on them."""

from __future__ import annotations

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import json_format, struct_pb2

from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import pick
from ext_proc.settings import PickerSettings, from_wire, to_wire
from ext_proc.shared_load import SharedLoad, others_of
from ext_proc.tiers import tier_for, tier_load
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder

EDGE = ("10.0.0.1:8000", "10.0.0.2:8000")
CLOUD = ("10.1.0.1:8000", "10.1.0.2:8000")


def routing(threshold: float = 0.6) -> RoutingTable:
    return RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity="soft"),),
                        spill_threshold=threshold)


def tiered(edge_health=health_check_pb2.HEALTHY, limit: int | None = 5) -> endpoint_pb2.ClusterLoadAssignment:
    """Two edge endpoints at priority 0 and two cloud endpoints at priority 1, each ``limit`` max concurrency."""
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="llm-v1")
    for priority, addresses, health in ((0, EDGE, edge_health), (1, CLOUD, health_check_pb2.HEALTHY)):
        loc = cla.endpoints.add(priority=priority)
        for address in addresses:
            host, port = address.split(":")
            lb = loc.lb_endpoints.add(health_status=health)
            lb.endpoint.address.socket_address.address = host
            lb.endpoint.address.socket_address.port_value = int(port)
            if limit is not None:
                lb.metadata.filter_metadata["inferlb"].update({"max_concurrency": limit})
    return cla


def test_the_view_keeps_the_cloud_tier_as_the_edge_tiers_spill():
    pool = EndpointView.build({"llm-v1": tiered()}, routing()).clusters["llm-v1"]
    assert pool.endpoints == EDGE and pool.capacity == 10
    assert pool.spill is not None and pool.spill.endpoints == CLOUD and pool.spill.capacity == 10
    # An unhealthy edge: the cloud is the first pinnable level, with nothing to spill to.
    pool = EndpointView.build({"llm-v1": tiered(health_check_pb2.UNHEALTHY)}, routing()).clusters["llm-v1"]
    assert pool.endpoints == CLOUD and pool.spill is None


def test_requests_stay_on_the_edge_below_the_threshold_and_spill_at_it():
    pool = EndpointView.build({"llm-v1": tiered()}, routing()).clusters["llm-v1"]
    assert tier_load(pool, {EDGE[0]: 3, EDGE[1]: 2, CLOUD[0]: 7}) == 0.5   # cloud requests don't count
    assert tier_for(pool, {EDGE[0]: 3, EDGE[1]: 2}, 0.6) is pool
    assert tier_for(pool, {EDGE[0]: 3, EDGE[1]: 3}, 0.6) is pool.spill
    assert tier_for(pool, {EDGE[0]: 3, EDGE[1]: 3}, 0.7) is pool


def test_an_edge_without_a_known_max_concurrency_never_spills():
    pool = EndpointView.build({"llm-v1": tiered(limit=None)}, routing()).clusters["llm-v1"]
    assert pool.capacity == 0 and tier_for(pool, {EDGE[0]: 100}, 0.6) is pool


def test_pick_fills_the_edge_to_the_threshold_then_the_cloud():
    """Requests that never finish: the first ceil(0.6 x 10) = 6 land on the edge, the rest in the cloud,
    spread by the bounded loads over the cloud's endpoints."""
    view = EndpointView.build({"llm-v1": tiered()}, routing())
    live = InFlight()
    placed = []
    for i in range(12):
        d = pick({":authority": b"x", "x-request-id": str(i).encode()}, view, live)
        live.picked(d.cluster, d.endpoint, d.work)
        placed.append(d.endpoint)
    assert all(e in EDGE for e in placed[:6]) and all(e in CLOUD for e in placed[6:])
    assert sorted(live.endpoints[e] for e in CLOUD) == [3, 3]


def test_the_cloud_gets_nothing_while_the_edge_stays_under_the_threshold():
    """Every edge load under 60 % of 10 (up to 5 in flight), with and without sessions: an edge endpoint."""
    view = EndpointView.build({"llm-v1": tiered()}, routing())
    for a in range(6):
        for b in range(6 - a):
            for key in (b"", b"s1", b"s2", b"s3"):
                d = pick({":authority": b"x", "x-session-id": key}, view, {EDGE[0]: a, EDGE[1]: b, CLOUD[0]: 1})
                assert d.endpoint in EDGE, (a, b, key)


def test_admission_counts_both_tiers_capacity():
    handler = PickerHandler(ViewHolder(EndpointView.build({"llm-v1": tiered()}, routing())))
    assert handler.control._capacity(handler.holder.current, "llm-v1") == 20
    handler = PickerHandler(ViewHolder(EndpointView.build({"llm-v1": tiered(limit=None)}, routing())))
    assert handler.control._capacity(handler.holder.current, "llm-v1") == 0


def test_the_threshold_travels_over_xds():
    settings = PickerSettings(130.0, 1800.0, 1000, False, 256, 0.1, 1, False, 3, 5.0, 0.999, 20, True, 0.1, 1.0,
                              "routing", "tcp://{host}:5557", "", 5.0)
    struct = json_format.ParseDict(to_wire(routing(0.45), settings), struct_pb2.Struct())
    back, _ = from_wire(json_format.MessageToDict(struct))
    assert back.spill_threshold == 0.45


def test_a_request_no_edge_endpoint_has_memory_for_goes_to_the_cloud_under_the_threshold():
    view = EndpointView.build({"llm-v1": tiered()}, routing())
    live = InFlight()
    live.set_samples(MemorySamples.of({e: (1000.0, 0.0) for e in EDGE} | {e: (50000.0, 0.0) for e in CLOUD}))
    d = pick({":authority": b"x"}, view, live)   # the default need, 2 GiB x 1.2: no edge endpoint has it
    assert d.endpoint in CLOUD and d.reason == "least-loaded"
    live.set_samples(MemorySamples.of({e: (1000.0, 0.0) for e in EDGE + CLOUD}))
    d = pick({":authority": b"x"}, view, live)
    assert d.endpoint is None and d.reason == "no-memory"


def test_with_the_shared_view_the_other_pickers_edge_requests_count_toward_the_threshold():
    """Three requests of another gateway's picker on the edge and three of this one's: 6 of 10 = the
    threshold, so the next request goes to the cloud (alone, this picker would see 3 of 10)."""
    view = EndpointView.build({"llm-v1": tiered()}, routing())
    own = InFlight()
    shared = SharedLoad(own)
    for _ in range(3):
        own.picked("llm-v1", EDGE[0], 1.0)
    shared.set_others(others_of({("llm-v1", EDGE[1]): (3, 3.0, 0.0)}, {"llm-v1": (3, 3.0)}, {}, {}))
    assert shared.endpoints.get(EDGE[0], 0) == 3 and shared.endpoints.get(EDGE[1], 0) == 3
    assert pick({":authority": b"x", "x-request-id": b"r"}, view, shared).endpoint in CLOUD
    assert pick({":authority": b"x", "x-request-id": b"r"}, view, own).endpoint in EDGE
