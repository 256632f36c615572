"""The two session-affinity contracts (issue 37): ``strict`` keeps a session on its endpoint whatever
the load and moves it only when the endpoint is unusable; ``soft`` spills under load and moves the
session when the spill persists. Hand-made cases through the picker's own request path."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from ext_proc.admission import Admission
from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import pick
from ext_proc.ring import key_hash
from ext_proc.sampler import DecisionSampler
from ext_proc.scheduling import Request, default_profile
from ext_proc.scheduling.affinity import STRICT_PLUGIN, strict_choice
from ext_proc.sessions import SessionTable, session_slot
from ext_proc.settings import PickerSettings, from_wire, to_wire
from ext_proc.telemetry import OUTCOMES
from ext_proc.transport.base import StreamState
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder
from inferlb.picker_config import routing_table
from tests.unit.ext_proc.test_scheduler import _log as access_log
from tests.unit.ext_proc.test_tiers import CLOUD, EDGE, tiered
from xds_server.config import parse_config

FOUR = tuple(f"10.0.0.{i}:8000" for i in range(4))
HEALTHY, UNHEALTHY, DRAINING = health_check_pb2.HEALTHY, health_check_pb2.UNHEALTHY, health_check_pb2.DRAINING


def routing(affinity: str) -> RoutingTable:
    return RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity=affinity),))


def cla(health: dict[str, int] | None = None, endpoints=FOUR) -> endpoint_pb2.ClusterLoadAssignment:
    """Cluster ``c``: ``endpoints`` with equal weights, HEALTHY unless ``health`` says otherwise."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name="c")
    locality = assignment.endpoints.add()
    for address in endpoints:
        host, port = address.rsplit(":", 1)
        lb = locality.lb_endpoints.add(health_status=(health or {}).get(address, HEALTHY))
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.load_balancing_weight.value = 1
    return assignment


def handler_for(affinity: str, **kw) -> PickerHandler:
    return PickerHandler(ViewHolder(EndpointView.build({"c": cla()}, routing(affinity))), pin_move_after=3, **kw)


def message(session: bytes) -> bytes:
    values = {":authority": b"x", ":path": b"/v1/chat/completions", "x-session-id": session}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]), end_of_stream=True)
    ).SerializeToString()


def endpoint_of(answer: bytes) -> str:
    r = pb.ProcessingResponse.FromString(answer)
    got = {o.header.key: o.header.raw_value for o in r.request_headers.response.header_mutation.set_headers}
    return got["x-gateway-destination-endpoint"].decode()


def turn(handler: PickerHandler, session: bytes = b"alice") -> str:
    """One turn of ``session`` through the handler; it completes at once (the next turn sees only the
    load the test puts there)."""
    e = endpoint_of(handler.process(StreamState(), message(session))[0])
    handler.control.inflight.completed("c", e)
    return e


def load(handler: PickerHandler, endpoint: str, n: int) -> None:
    """``n`` requests of other clients in flight on ``endpoint``."""
    for _ in range(n):
        handler.control.inflight.picked("c", endpoint, 1.0)


def test_strict_keeps_every_turn_on_a_loaded_endpoint_and_names_the_contract():
    sampler = DecisionSampler(every=1)
    h = handler_for("strict", sampler=sampler)
    home = turn(h)
    load(h, home, 40)  # far over any bound: 40 of 40 in flight on one of four endpoints
    before = OUTCOMES.get(("affinity", STRICT_PLUGIN), 0)
    assert [turn(h) for _ in range(10)] == [home] * 10
    assert OUTCOMES.get(("affinity", STRICT_PLUGIN), 0) == before + 10  # counted as strict pins
    [last, *_] = sampler.recent()
    assert (last.endpoint, last.reason, last.plugins) == (home, "affinity", STRICT_PLUGIN)  # and sampled


def test_soft_spills_under_the_same_load_then_moves_the_session_as_today():
    h = handler_for("soft")
    home = turn(h)
    load(h, home, 40)
    spills = [turn(h) for _ in range(2)]
    assert home not in spills  # two spills: the pin stays (pin_move_after 3)
    slot = next(iter(h.control.sessions._entries))
    assert h.control.sessions.get(slot) == home
    moved = turn(h)
    assert moved != home and h.control.sessions.get(slot) == moved  # the third moves it


@pytest.mark.parametrize("health", [UNHEALTHY, DRAINING])
def test_strict_moves_a_session_whose_endpoint_turns_unhealthy_or_draining_and_it_stays_moved(health):
    h = handler_for("strict")
    home = turn(h)
    h.holder.update({"c": cla({home: health})}, routing("strict"))
    new = turn(h)
    assert new != home
    h.holder.update({"c": cla()}, routing("strict"))  # the old endpoint is back: the session stays
    assert [turn(h) for _ in range(3)] == [new] * 3


def test_strict_moves_a_session_whose_endpoint_is_gone():
    h = handler_for("strict")
    home = turn(h)
    h.holder.update({"c": cla(endpoints=tuple(e for e in FOUR if e != home))}, routing("strict"))
    assert turn(h) != home


def test_strict_moves_a_session_whose_endpoint_refuses_connections():
    h = PickerHandler(ViewHolder(EndpointView.build({"c": cla()}, routing("strict"))),
                      inflight=InFlight(clock=lambda: 0.0, failure_hold_s=5.0))
    home = turn(h)
    h.access_log(access_log(home, flag="upstream_connection_failure", status=503))
    assert home in h.control.inflight.failed
    new = turn(h)
    assert new != home
    assert turn(h) == new


@pytest.mark.parametrize("affinity", ["strict", "soft"])
def test_a_strict_session_stays_in_its_pins_tier_whatever_the_edges_load(affinity):
    """Edge at 6 of 10 in flight (the 0.6 threshold): other requests go to the cloud; a strict session
    pinned on the edge stays there, a soft one moves (its pin is not in the cloud tier)."""
    table = RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity=affinity),))
    view = EndpointView.build({"llm-v1": tiered()}, table)
    pins = SessionTable()
    pins.touch(session_slot(key_hash(b"s"), view.clusters["llm-v1"].salt), EDGE[0])
    d = pick({":authority": b"x", "x-session-id": b"s"}, view, {EDGE[0]: 3, EDGE[1]: 3}, pins)
    if affinity == "strict":
        assert (d.endpoint, d.reason, d.plugins) == (EDGE[0], "affinity", STRICT_PLUGIN)
    else:
        assert d.endpoint in CLOUD and d.reason == "repinned"
    # pinned in the cloud while the edge is idle: strict stays in the cloud
    pins.touch(session_slot(key_hash(b"s"), view.clusters["llm-v1"].salt), CLOUD[1])
    d = pick({":authority": b"x", "x-session-id": b"s"}, view, {}, pins)
    assert (d.endpoint == CLOUD[1]) == (affinity == "strict")


def test_strict_choice_asks_only_the_hard_filters_about_the_pin():
    """On a hand-made request: the pin over every bound is kept; a pin gone or failing is the
    profile's to move (None); a pin without memory waits (no endpoint)."""
    view = EndpointView.build({"c": cla()}, routing("strict"))
    pool = view.clusters["c"]
    profile = default_profile()
    loads = {FOUR[0]: 100.0}
    base = Request("c", pool, 7, "session", FOUR[0], b"", 1.0, 0.0, loads, 100.0, None, frozenset(), None, None)
    assert strict_choice(base, profile) == (FOUR[0], "affinity", STRICT_PLUGIN)
    assert strict_choice(base._replace(failed=frozenset({FOUR[0]})), profile) is None
    assert strict_choice(base._replace(pinned="10.9.9.9:8000"), profile) is None
    hungry = base._replace(need_mib=4000.0, free_mib={FOUR[0]: 100.0, FOUR[1]: 50_000.0})
    assert strict_choice(hungry, profile) == (None, "no-memory", f"memory-admission+{STRICT_PLUGIN}")


def _immediate(answer: bytes) -> tuple[int, dict[str, bytes], str]:
    r = pb.ProcessingResponse.FromString(answer).immediate_response
    return (r.status.code, {h.header.key: h.header.raw_value for h in r.headers.set_headers},
            json.loads(r.body)["error"]["message"])


def test_strict_without_the_memory_queue_answers_429_when_the_pin_has_no_memory_never_another_endpoint():
    h = handler_for("strict", memory_queue=False, retry_after_s=2)
    home = turn(h)
    others = {e: (50_000.0, 0.0) for e in FOUR if e != home}
    h.control.set_samples(MemorySamples.of({home: (100.0, 0.0), **others}))  # the default need: 2048 MiB x 1.2
    status, extra, message_ = _immediate(h.process(StreamState(), message(b"alice"))[0])
    assert status == 429 and extra["retry-after"] == b"2" and "session_affinity: strict" in message_
    assert not h.control.inflight.clusters
    h.control.set_samples(MemorySamples.of({home: (50_000.0, 1.0), **others}))
    assert turn(h) == home
    # soft, same case: the turn goes to an endpoint with memory
    s = handler_for("soft", memory_queue=False)
    home = turn(s)
    s.control.set_samples(MemorySamples.of({home: (100.0, 0.0), **{e: (50_000.0, 0.0) for e in FOUR if e != home}}))
    assert turn(s) != home


async def test_strict_with_the_memory_queue_waits_for_its_pin_to_have_memory():
    h = handler_for("strict", admission=Admission(8, 1.0, retry_after_s=1), memory_queue=True,
                    limit_concurrency=False)
    home = turn(h)
    others = {e: (50_000.0, h.control.inflight.now()) for e in FOUR if e != home}
    h.control.set_samples(MemorySamples.of({home: (100.0, h.control.inflight.now()), **others}))
    waiting, _ = h.process(StreamState(), message(b"alice"))
    assert isinstance(waiting, asyncio.Future) and not waiting.done()  # others have memory: it still waits
    h.control.set_samples(MemorySamples.of({home: (50_000.0, h.control.inflight.now() + 1.0), **others}))
    assert waiting.done() and endpoint_of(waiting.result()) == home


def test_the_contract_is_a_service_setting_strict_by_default_and_travels_over_xds():
    doc = ("services:\n  - name: chat\n    versions: [{name: v1, endpoints: [{address: '10.0.0.1:8000'}]}]\n"
           "  - name: embed\n    hosts: [embed]\n    session_affinity: soft\n"
           "    versions: [{name: e1, endpoints: [{address: '10.0.0.2:8000'}]}]\n")
    table = routing_table(parse_config(doc, "<test>"))
    assert [(s.name, s.affinity) for s in table.services] == [("chat", "strict"), ("embed", "soft")]
    settings = PickerSettings(130.0, 1800.0, 1000, False, 256, 0.1, 1, False, 3, 5.0, 0.999, 20, True, 0.1, 1.0,
                              "routing", "tcp://{host}:5557", "", 5.0)
    struct = json_format.ParseDict(to_wire(table, settings), struct_pb2.Struct())
    back, _ = from_wire(json_format.MessageToDict(struct))
    assert [s.affinity for s in back.services] == ["strict", "soft"]
    with pytest.raises(ValueError, match="affinity must be one of strict, soft"):
        ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity="sticky")
