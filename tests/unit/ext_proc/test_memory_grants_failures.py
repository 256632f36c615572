"""Memory grants where they can go wrong: a control-plane restart or stall, concurrency slots, the
Envoy timeout budget, endpoints leaving while a grant is asked, the memory margin, the ledger's cost."""

from __future__ import annotations

import asyncio

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.admission import Admission
from ext_proc.body import NO_BODY
from ext_proc.grants import Grants
from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.load_client import report_message, run_load_view
from ext_proc.requestcontrol import GRANT_TIMEOUT_S
from ext_proc.shared_load import NO_OTHERS, SharedLoad, others_of
from ext_proc.view import EndpointView, RoutingTable, ViewHolder
from protos import load_view_pb2, load_view_pb2_grpc
from tests.unit.ext_proc.test_admission import ROUTING as LIMITED_ROUTING
from tests.unit.ext_proc.test_admission import limited
from tests.unit.ext_proc.test_memory_grants import MEMORY, A, contended_handler
from tests.unit.ext_proc.test_scheduler import FOUR, headers, view
from xds_server.loadview.exchange import report_from
from xds_server.loadview.grants import GrantLedger
from xds_server.loadview.table import LoadTable


def test_a_control_plane_restart_makes_every_new_grant_look_seen():
    """The picker's ``applied`` is a max over grant numbers; a restarted control plane numbers its
    grants from 1 again, so the old max says every new grant to that picker is already counted."""
    p1 = Grants()
    p1.answer(999, 5000, 0.0)       # the old control plane's grant 5000 (its answer)
    p1.lost()                        # the control plane restarts: the stream breaks
    table = LoadTable(expiry_s=1.0)  # the new control plane
    table.record(report_from(report_message(InFlight(), "p1", 1, 0.0, p1)), 0.0)
    ledger = GrantLedger(keep_s=1.0)
    first, _ = ledger.decide("p1", A, 16000.0, 4000.0, {}, 0.001)
    assert first == 1
    # p2's view was built before p1 even knew of grant 1: nothing of it is in p2's estimate.
    second, unseen = ledger.decide("p2", A, 16000.0, 4000.0, table.grants_seen(), 0.002)
    assert second == 0 and unseen == 16000.0, \
        f"p2 granted the room p1 was just granted (grant {second}, unseen {unseen}): both fill 20000 MiB with 32000"


def test_a_refusal_note_is_not_held_while_the_view_is_lost():
    """``Grants.lost`` clears the outbox and the waiting requests, not ``refused_mib``: the others'
    load is dropped (NO_OTHERS) yet their 'unseen' memory stays subtracted until a view comes back
    (a control plane down for minutes: that endpoint's memory is held for minutes)."""
    shared = SharedLoad(InFlight())
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    shared.inflight.set_samples(MemorySamples.of({A: (20000.0, shared.inflight.now())}))
    request = shared.grants.ask("c", A, 8000.0, 12000.0, lambda g, u: None)
    shared.grants.answer(request, 0, 16000.0)
    # what run_load_view's lost() does:
    shared.grants.lost()
    shared.set_others(NO_OTHERS)
    shared.viewed_at = None
    assert shared.free.get(A) == 20000.0, f"alone, the picker still leaves aside {20000.0 - shared.free.get(A)} MiB"


def limited_handler() -> tuple[PickerHandler, SharedLoad]:
    routing = RoutingTable(services=LIMITED_ROUTING.services, request_memory_header="x-mib")
    handler = PickerHandler(ViewHolder(EndpointView.build({"llm-v1": limited([1, 1])}, routing)),
                            admission=Admission(8, 1.0, retry_after_s=1))
    handler.control.inflight.streams = 1
    shared = handler.control.share_load()
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    shared.inflight.set_samples(MemorySamples.of({f"10.0.0.{i}:8000": (80000.0, shared.inflight.now())
                                                  for i in range(2)}))
    return handler, shared


async def test_requests_waiting_for_a_grant_take_no_concurrency_slot():
    """The cluster's capacity is 2; requests waiting for their grant are not in flight, so every one
    that arrives in those milliseconds is admitted: 5 requests run on 2 slots, none queued."""
    handler, shared = limited_handler()
    answers = [handler.control.route(headers(x_session_id=f"s{i}".encode(), x_mib=b"1000"), handler.holder.current,
                                     NO_BODY, "request_headers") for i in range(5)]
    queued = handler.control.admission.queued("llm-v1")
    for request_id, *_ in shared.grants.take_outbox():
        shared.grants.answer(request_id, request_id, 0.0)
    await asyncio.sleep(0)
    running = shared.inflight.clusters.get("llm-v1", 0)
    assert running <= 2, f"{running} requests in flight on a capacity of 2 ({queued} queued)"
    for a in answers:
        if isinstance(a, asyncio.Future):
            a.cancel()


async def test_the_worst_chain_of_grant_waits_exceeds_envoys_message_timeout():
    """Answers that come just inside GRANT_TIMEOUT_S: 3 refusals, the memory queue (queue_timeout_s
    0.1, the default), released at its end and refused once more. Envoy's ext_proc message timeout is
    250 ms by default (config validation checks only queue_timeout_s against it)."""
    handler, shared = contended_handler(admission=Admission(4, 0.1, retry_after_s=1))
    grants = shared.grants
    loop = asyncio.get_running_loop()
    start = loop.time()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")

    async def control_plane() -> None:   # answers each request refused, 45 ms later
        while not answer.done():
            for request_id, *_ in grants.take_outbox():
                loop.call_later(0.045, grants.answer, request_id, 0, 16000.0)
            if handler.control.admission.queued("c") and loop.time() - start > 0.23:
                grants.viewed(grants.view + 1)   # a new view: the refusal notes go, the room is back
                handler.control.tick()                    # and a completion releases the queue
            await asyncio.sleep(0.002)

    task = asyncio.create_task(control_plane())
    await asyncio.wait_for(answer, 2.0)
    took = loop.time() - start
    task.cancel()
    assert took < 0.25, f"decided after {took * 1000:.0f} ms: Envoy gave up at 250 ms"


class _Mute(load_view_pb2_grpc.LoadViewServiceServicer):
    """A control plane that sends one view, then reads reports and never answers again (stalled)."""

    async def Share(self, request_iterator, context):  # noqa: N802
        first = True
        async for _ in request_iterator:
            if first:
                first = False
                yield load_view_pb2.LoadView(seq=1, pickers=3, view=1)


async def _stays_viewed_while(asking: bool) -> bool:
    server = grpc.aio.server()
    load_view_pb2_grpc.add_LoadViewServiceServicer_to_server(_Mute(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    shared = SharedLoad(InFlight())
    task = asyncio.create_task(run_load_view(f"127.0.0.1:{port}", "p1", shared, 0.01, 0.3))
    try:
        for _ in range(300):
            if shared.viewed_at is not None:
                break
            await asyncio.sleep(0.01)
        for _ in range(100):  # 1 s: a memory admission every 5 ms (each waits 50 ms, then local)
            if asking:
                request_id = shared.grants.ask("c", A, 1.0, 1.0, lambda g, u: None)
                asyncio.get_running_loop().call_later(0.05, shared.grants.drop, request_id)
            await asyncio.sleep(0.005)
        return shared.others is not NO_OTHERS
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(None)


async def test_a_stalled_view_is_dropped_after_expiry_even_while_grants_are_asked():
    assert not await _stays_viewed_while(asking=False), "control: without grant requests the view is dropped"
    assert not await _stays_viewed_while(asking=True), \
        "with a grant request every 5 ms, the 0.3 s-stale view is kept for 1 s (every admission waits 50 ms)"


async def test_a_grant_answered_after_its_endpoint_left_the_view_does_not_pin_it():
    """The decision waits up to 50 ms for its grant; an EDS update meanwhile removes (or ejects)
    its endpoint. The commit still pins it (override_host ignores health): the design says only
    healthy, pinnable endpoints are ever pinned (the queue decides again at release; this does not)."""
    from tests.unit.ext_proc.test_memory_grants import MEMORY
    from tests.unit.ext_proc.test_scheduler import FOUR, cla

    handler, shared = contended_handler()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    [(request_id, _, endpoint, _, _)] = shared.grants.take_outbox()
    handler.holder.current = EndpointView.build({"c": cla("c", {e: 1 for e in FOUR if e != endpoint})}, MEMORY)
    shared.grants.answer(request_id, 7, 0.0)
    await asyncio.wait_for(answer, 1.0)
    response = pb.ProcessingResponse.FromString(answer.result())
    pinned = [h.header.raw_value.decode() for h in response.request_headers.response.header_mutation.set_headers
              if h.header.key == "x-gateway-destination-endpoint"]
    assert pinned and pinned[0] != endpoint, f"pinned {pinned} after {endpoint} left the view"


async def test_the_room_a_grant_request_sends_keeps_the_memory_margin():
    """An estimated need (no declared MiB) is admitted only with ``memory_margin`` (20 %) on top, but
    the room sent to the ledger is ``free - need``: the ledger then grants while the others' unseen
    grants take the margin too, a fill the picker itself (seeing them) would have refused."""
    from tests.unit.ext_proc.test_scheduler import FOUR, ROUTING, view

    estimated = RoutingTable(services=ROUTING.services, default_request_mib=8000.0, memory_margin=0.2)
    handler = PickerHandler(ViewHolder(view(routing=estimated)))
    shared = handler.control.share_load()
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    shared.inflight.set_samples(MemorySamples.of({e: (20000.0, shared.inflight.now()) for e in FOUR}))
    answer = handler.control.route(headers(x_session_id=b"s1"), handler.holder.current, NO_BODY, "request_headers")
    [(_, _, endpoint, mib, room)] = shared.grants.take_outbox()
    ledger = GrantLedger(1.0)
    ledger.decide("other", endpoint, room, 0.0, {}, 0.0)      # another picker's unseen grant of `room` MiB
    granted, unseen = ledger.decide("me", endpoint, mib, room, {}, 0.001)
    answer.cancel()
    left = 20000.0 - unseen - mib
    assert granted and left >= 0.2 * mib, f"granted: {left} MiB left on {endpoint} for a margin of {0.2 * mib} MiB"
    assert ledger.decide("other", endpoint, 1.0, 1e9, {}, 0.002)[0]
    assert ledger.decide("me", endpoint, mib, room, {}, 0.003)[0] == 0, "one MiB more of the others': refused"


class _Touches(dict):
    """The ledger's grants by endpoint, counting the endpoints expiry reads; walking them all raises."""

    reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)

    def _walk(self, *_):
        raise AssertionError("expiry walked every endpoint with a grant")

    __iter__ = items = keys = values = _walk


def test_the_ledger_expires_grants_in_work_proportional_to_what_expires():
    """``GrantLedger.expire`` scanned every endpoint with a grant on every decision: quadratic in the
    grants of the last second (60 000 endpoints: 5 000 grants/s took 2.6 s of CPU per second). Now
    each decision reads only the endpoints whose grants expire (counted, not timed)."""
    ledger = GrantLedger(1.0)
    ledger._grants = touches = _Touches()
    rate = 5000
    for i in range(rate):
        ledger.decide(f"p{i % 4}", f"10.0.{i // 256}.{i % 256}:8000", 100.0, 1e6, {}, i / rate)
    assert touches.reads == 0, "nothing was old enough to expire, yet endpoints were read"
    ledger.decide("p1", "x", 1.0, 1e6, {}, 1.5)
    assert touches.reads == rate // 2 + 1, "the grants up to 0.5 s, each read once"
    assert ledger.decide("p2", "10.0.0.1:8000", 1.0, 0.0, {}, 1.5)[0], "grants older than keep_s forgotten"
    assert ledger.decide("p2", "10.0.19.135:8000", 100.0, 99.0, {}, 1.5)[0] == 0, "younger ones kept"


def test_a_view_applied_between_the_ask_and_its_report_is_not_the_one_the_ledger_is_told():
    """p2 reckons its room on view 4; view 5, which shows p1's 18 GiB grant, is applied before the
    report with p2's request goes out. Told view 5, the ledger took p1's grant as in p2's room and
    granted both: 36 GiB on a GPU with 24 (an OOM in a ``multi_gateway`` round)."""
    table, ledger = LoadTable(expiry_s=1.0), GrantLedger(keep_s=1.0)
    grant, _ = ledger.decide("p1", A, 18432.0, 6144.0, {}, 0.0)
    seen = {4: {}, 5: {"p1": grant}}   # what each view sent to p2 showed of the grants
    p2 = Grants()
    p2.viewed(4)
    p2.ask("c", A, 18432.0, 6144.0, lambda g, u: None)   # the room of view 4: p1's grant not in it
    p2.viewed(5)
    msg = report_message(InFlight(), "p2", 1, 0.0, p2)
    table.record(report_from(msg), 0.01)
    [ask] = msg.grant_requests
    number, unseen = ledger.decide("p2", ask.endpoint, ask.memory_mib, ask.room_mib, seen[msg.view_applied], 0.01)
    assert (number, unseen) == (0, 18432.0), f"view_applied {msg.view_applied}: granted against p1's grant"
    later = report_message(InFlight(), "p2", 2, 0.0, p2)
    assert later.view_applied == 5, "a report without requests tells the view applied last"


async def test_without_the_memory_queue_an_unanswered_grant_is_not_waited_out_then_pinned_blind():
    """``memory_queue: false`` (the default) with admission on: no memory 429 exists, so the deadline
    wait ended in ``_no_memory``'s best-effort pin: the request waited the whole ``queue_timeout_s``
    and was then committed, unknown to the ledger, on the endpoint with the most estimated free
    memory (not the one it was decided on and asked for): the blind commit the wait meant to avoid,
    only later and elsewhere. Without a 429 to give, it is decided locally after GRANT_TIMEOUT_S."""
    handler = PickerHandler(ViewHolder(view(routing=MEMORY)), admission=Admission(4, 0.5, retry_after_s=1),
                            memory_queue=False)
    shared = handler.control.share_load()
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    shared.inflight.set_samples(MemorySamples.of({e: (20000.0 + i, shared.inflight.now())
                                                  for i, e in enumerate(FOUR)}))   # FOUR[-1] has the most
    loop = asyncio.get_running_loop()
    start = loop.time()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    [(_, _, asked, _, _)] = list(shared.grants.outbox)
    assert asked != FOUR[-1], "the session's endpoint is not the one with the most free memory"
    await asyncio.wait_for(answer, 2.0)
    waited = loop.time() - start
    assert waited < 0.25, f"waited {waited:.3f} s for a grant (GRANT_TIMEOUT_S {GRANT_TIMEOUT_S})"
    assert shared.inflight.endpoints == {asked: 1}, f"committed on {shared.inflight.endpoints}, asked for {asked}"
