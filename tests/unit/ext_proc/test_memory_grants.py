"""Memory grants: the control plane's ledger, the picker's bookkeeping, the handler asking before it
commits a contended admission, and two pickers through a real load-view service (grpc.aio)."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.admission import Admission
from ext_proc.body import NO_BODY
from ext_proc.grants import Grants
from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.load_client import report_message, run_load_view
from ext_proc.requestcontrol import GRANT_TIMEOUT_S, GRANT_TRIES
from ext_proc.shared_load import SharedLoad, freed, others_of
from ext_proc.view import RoutingTable, ViewHolder
from protos import load_view_pb2
from tests.support.loadview import load_view_server
from tests.unit.ext_proc.test_scheduler import FOUR, ROUTING, headers, view
from tests.unit.ext_proc.test_shared_load import until
from xds_server.loadview.exchange import grant_requests, report_from
from xds_server.loadview.grants import DEFER_S, GrantLedger
from xds_server.loadview.table import LoadTable

A, B = FOUR[0], FOUR[1]
MEMORY = RoutingTable(services=ROUTING.services, request_memory_header="x-mib")


# --- the ledger (control plane) ------------------------------------------------------------------


def test_the_ledger_refuses_a_room_the_others_unseen_grants_took():
    ledger = GrantLedger(keep_s=1.0)
    first, unseen = ledger.decide("p1", A, 8000.0, room_mib=4000.0, seen={}, now=10.0)
    assert first == 1 and unseen == 0.0
    assert ledger.decide("p2", A, 8000.0, room_mib=4000.0, seen={}, now=10.001) == (0, 8000.0), \
        "p2's estimate did not hold p1's 8000 MiB: the room was taken"
    assert ledger.decide("p2", A, 8000.0, room_mib=9000.0, seen={}, now=10.002)[0] == 3 - 1, \
        "room for both"
    assert ledger.decide("p2", B, 8000.0, room_mib=0.0, seen={}, now=10.003)[0] == 3, "another endpoint"


def test_a_grant_the_askers_view_shows_and_the_askers_own_grants_do_not_count():
    ledger = GrantLedger(keep_s=1.0)
    number, _ = ledger.decide("p1", A, 8000.0, 8000.0, {}, 10.0)
    second, _ = ledger.decide("p2", A, 8000.0, 0.0, {"p1": number}, 10.1)
    assert second, "p2's view holds p1's report with it"
    assert ledger.decide("p1", A, 8000.0, 0.0, {"p2": second}, 10.2)[0], "p1 counts its own grants itself"


def test_grants_are_forgotten_after_keep_s():
    ledger = GrantLedger(keep_s=1.0)
    ledger.decide("p1", A, 8000.0, 8000.0, {}, 10.0)
    assert ledger.decide("p2", A, 8000.0, 0.0, {}, 10.9)[0] == 0
    assert ledger.decide("p2", A, 8000.0, 0.0, {}, 11.01)[0] != 0
    with pytest.raises(ValueError, match="keep_s"):
        GrantLedger(keep_s=0)


def test_a_report_carries_the_grant_requests_and_what_they_apply():
    grants = Grants()
    grants.viewed(3)
    grants.ask("c", A, 8000.0, 1000.0, lambda g, u: None)
    grants.applied = 7
    msg = report_message(InFlight(), "p1", 1, 0.0, grants)
    assert grant_requests(msg) == [(1, A, 8000.0, 1000.0, "c", 0.0)] and not grants.outbox
    assert report_from(msg).grants_applied == 7 and msg.view_applied == 3
    bad = load_view_pb2.LoadReport(picker="p", grant_requests=[load_view_pb2.GrantRequest(id=1, endpoint=A,
                                                                                           memory_mib=-1)])
    with pytest.raises(ValueError, match=r"grant_requests\[1\]\.memory_mib"):
        grant_requests(bad)


def test_the_ledger_keeps_a_room_for_another_pickers_older_waiter_for_a_while():
    """p2's request has waited 30 ms for memory; p1 asks for a room on A for a request that just arrived:
    refused (the whole room: p1 leaves A aside until its next view), as one picker's queue serves its
    oldest first. Not for a waiter that needs more than the room, one younger, one in another cluster,
    nor p1's own; and a waiter holds rooms for DEFER_S only (its picker may never see the room)."""
    old = [("p2", 7, "c", 18000.0, 0.03)]
    ledger = GrantLedger(keep_s=1.0)
    assert ledger.decide("p1", A, 8000.0, 12000.0, {}, 10.0, "c", 0.0, old) == (0, 20000.0)
    assert ledger.decide("p1", A, 8000.0, 6000.0, {}, 10.0, "c", 0.0, old)[0], "18000 MiB do not fit in 14000"
    assert ledger.decide("p1", B, 8000.0, 12000.0, {}, 10.0, "c", 0.05, old)[0], "p1's request waited longer"
    assert ledger.decide("p1", B, 8000.0, 12000.0, {}, 10.0, "other", 0.0, old)[0], "another cluster"
    assert ledger.decide("p2", FOUR[2], 8000.0, 12000.0, {}, 10.0, "c", 0.0, old)[0], "its own queue is its own"
    assert ledger.decide("p1", A, 8000.0, 12000.0, {}, 10.0 + DEFER_S * 0.9, "c", 0.0, old)[0] == 0
    assert ledger.decide("p1", A, 8000.0, 12000.0, {}, 10.0 + DEFER_S * 1.1, "c", 0.0, old)[0], "held long enough"


def test_a_report_lists_the_memory_queue_and_the_table_tells_each_picker_the_others_waiters():
    """The picker's memory waiters (oldest first, with their need and wait) go with each report, and the
    grant request of a released waiter says how long it waited; the control plane tells each picker's
    asks the other live pickers' waiters, their waits counted to now."""
    grants = Grants()
    grants.queue = lambda: [(4, "c", 18000.0, 0.02)]
    grants.ask("c", A, 8000.0, 1000.0, lambda g, u: None, waited_s=0.04)
    msg = report_message(InFlight(), "p1", 1, 0.0, grants)
    assert grant_requests(msg) == [(1, A, 8000.0, 1000.0, "c", 0.04)]
    table = LoadTable(expiry_s=1.0)
    table.record(report_from(msg), 5.0)
    assert report_from(msg).waiting == ((4, "c", 18000.0, 0.02),)
    assert table.waiters("p2", 5.01) == [("p1", 4, "c", 18000.0, pytest.approx(0.03))]
    assert table.waiters("p1", 5.01) == [] and table.waiters("p2", 6.5) == [], "its own; an expired picker's"


# --- the picker's bookkeeping --------------------------------------------------------------------


def test_memory_asked_for_is_held_until_answered_and_a_refusal_until_the_next_view():
    grants = Grants()
    answers: list[tuple[int | None, float]] = []
    first = grants.ask("c", A, 8000.0, 100.0, lambda g, u: answers.append((g, u)))
    second = grants.ask("c", A, 2000.0, 100.0, lambda g, u: answers.append((g, u)))
    assert grants.held(A) == 10000.0
    grants.answer(first, 0, 6000.0)
    assert answers == [(0, 6000.0)] and grants.held(A) == 2000.0 + 6000.0
    grants.viewed(5)
    assert grants.held(A) == 2000.0 and grants.view == 5
    grants.drop(second)
    grants.answer(second, 12, 0.0)  # too late: not called back, but its grant counts as applied
    assert answers == [(0, 6000.0)] and grants.applied == 12 and grants.held(A) == 0.0
    grants.ask("c", B, 1.0, 0.0, lambda g, u: answers.append((g, u)))
    grants.lost()
    assert answers[-1] == (None, 0.0) and not grants.outbox and grants.held(B) == 0.0


def shared_with_others(deciding: int, free: dict[str, float]) -> SharedLoad:
    shared = SharedLoad(InFlight())
    shared.set_others(others_of({}, {}, {}, {}, pickers=deciding + 1))
    shared.inflight.set_samples(MemorySamples.of({e: (mib, shared.inflight.now()) for e, mib in free.items()}))
    return shared


def test_a_grant_is_asked_whenever_another_picker_decides_and_the_free_memory_is_known():
    shared = shared_with_others(2, {A: 20000.0, B: 100000.0})
    assert shared.grant_room(A, 8000.0) == 12000.0
    assert shared.grant_room(B, 8000.0) == 92000.0, "room to spare still asks: another may admit a larger one"
    assert shared.grant_room("10.9.9.9:1", 8000.0) is None, "free memory unknown: admitted as without a view"
    assert shared.grant_room(A, 0.0) is None
    alone = shared_with_others(0, {A: 20000.0})
    assert alone.grant_room(A, 8000.0) is None, "no other picker decides"
    idle = SharedLoad(InFlight())
    idle.set_others(others_of({}, {}, {}, {}, pickers=3, idle=2))
    idle.inflight.set_samples(MemorySamples.of({A: (20000.0, idle.inflight.now())}))
    assert idle.grant_room(A, 8000.0) is None, "the others are idle: nobody else decides"
    shared.grants.ask("c", A, 8000.0, 12000.0, lambda g, u: None)
    assert shared.free.get(A) == 12000.0, "memory waiting for a grant is not promised twice"


# --- the handler ---------------------------------------------------------------------------------


def contended_handler(free: float = 20000.0, admission: Admission | None = None
                      ) -> tuple[PickerHandler, SharedLoad]:
    handler = PickerHandler(ViewHolder(view(routing=MEMORY)), admission=admission)
    shared = handler.control.share_load()
    shared.set_others(others_of({}, {}, {}, {}, pickers=3))
    shared.inflight.set_samples(MemorySamples.of({e: (free, shared.inflight.now()) for e in FOUR}))
    return handler, shared


async def test_a_contended_admission_waits_for_its_grant_then_commits():
    handler, shared = contended_handler()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    assert isinstance(answer, asyncio.Future) and not answer.done()
    [(request_id, cluster, endpoint, mib, room)] = list(shared.grants.outbox)
    assert (cluster, mib, room) == ("c", 8000.0, 12000.0)
    assert shared.inflight.clusters.get("c", 0) == 0, "not counted before the grant"
    shared.grants.answer(request_id, 41, 0.0)
    assert answer.done() and isinstance(answer.result(), bytes)
    assert shared.inflight.endpoints.get(endpoint) == 1 and shared.grants.applied == 41


async def test_a_refused_admission_is_decided_again_off_the_refused_endpoint():
    handler, shared = contended_handler()
    h = headers(x_session_id=b"s1", x_mib=b"8000")
    answer = handler.control.route(h, handler.holder.current, NO_BODY, "request_headers")
    [(first_id, _, refused, _, _)] = shared.grants.take_outbox()
    shared.grants.answer(first_id, 0, 16000.0)  # others took 16000 of the 20000 MiB unseen
    [(second_id, _, again, _, _)] = shared.grants.take_outbox()
    assert again != refused and not answer.done()
    shared.grants.answer(second_id, 9, 0.0)
    await asyncio.wait_for(answer, 1.0)  # resolved through the re-decision's own future
    assert shared.inflight.endpoints.get(again) == 1 and refused not in shared.inflight.endpoints


async def test_after_grant_tries_refusals_the_request_waits_for_memory_like_one_without_room():
    handler, shared = contended_handler(admission=Admission(4, 0.1, retry_after_s=1))
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    for _ in range(GRANT_TRIES):
        [(request_id, *_)] = shared.grants.take_outbox()
        shared.grants.answer(request_id, 0, 16000.0)
    assert not answer.done() and handler.control.admission.queued("c") == 1 and not shared.grants.outbox
    response = pb.ProcessingResponse.FromString(await asyncio.wait_for(answer, 2.0))
    assert response.immediate_response.status.code == 429 and not shared.inflight.endpoints


async def test_no_answer_in_time_is_decided_locally():
    handler, shared = contended_handler()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    await asyncio.wait_for(answer, GRANT_TIMEOUT_S * 20)
    assert sum(shared.inflight.endpoints.values()) == 1 and not shared.grants.held(A)


async def test_with_admission_no_answer_by_the_deadline_is_a_429_not_a_commit():
    """Committed unanswered, the request is one the ledger would grant others' room against: it hears
    of it only later (35 of 55 OOMs of two multi_gateway rounds came after such a commit)."""
    handler, shared = contended_handler(admission=Admission(4, 0.1, retry_after_s=1))
    loop = asyncio.get_running_loop()
    start = loop.time()
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    assert shared.grants.take_outbox(), "asked"
    response = pb.ProcessingResponse.FromString(await asyncio.wait_for(answer, 2.0))
    assert response.immediate_response.status.code == 429 and not shared.inflight.endpoints
    assert 0.1 <= loop.time() - start < 0.2, "it waited for the whole queue timeout, not GRANT_TIMEOUT_S"
    assert not shared.grants.held(A) and not shared.grants.pending


async def test_an_admission_commits_at_once_when_no_other_picker_decides():
    handler, shared = contended_handler()
    shared.set_others(others_of({}, {}, {}, {}, pickers=1))
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    assert isinstance(answer, bytes) and not shared.grants.outbox


# --- two pickers through the control plane -------------------------------------------------------


async def test_two_pickers_cannot_both_take_the_same_room():
    """Both estimates show 20000 MiB free on A; each asks for 16000 MiB there before seeing the
    other's request: the ledger grants one and refuses the other."""
    table = LoadTable(expiry_s=1.0)
    one, two = SharedLoad(InFlight()), SharedLoad(InFlight())
    async with load_view_server(table) as target:
        tasks = [asyncio.create_task(run_load_view(target, name, shared, 0.01, 1.0))
                 for name, shared in (("one", one), ("two", two))]
        try:
            for shared in (one, two):
                shared.inflight.picked("c", B)  # traffic: each is a deciding picker for the other
            await until(lambda: one.others.idle == 0 and two.others.idle == 0 and one.others.pickers == 2
                        and two.others.pickers == 2 and one.grants.view > 0 and two.grants.view > 0)
            answers: dict[str, tuple[int | None, float]] = {}
            one.grants.ask("c", A, 16000.0, 4000.0, lambda g, u: answers.__setitem__("one", (g, u)))
            two.grants.ask("c", A, 16000.0, 4000.0, lambda g, u: answers.__setitem__("two", (g, u)))
            await until(lambda: len(answers) == 2)
            granted = [name for name, (g, _) in answers.items() if g]
            assert len(granted) == 1, answers
            refused = "two" if granted == ["one"] else "one"
            assert answers[refused] == (0, 16000.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_request_released_from_the_queue_and_refused_waits_again():
    handler, shared = contended_handler(free=5000.0, admission=Admission(4, 1.0, retry_after_s=1))
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    assert handler.control.admission.queued("c") == 1 and not shared.grants.outbox, "no endpoint has the memory: queued"
    handler.control.set_samples(MemorySamples.of({e: (20000.0, shared.inflight.now()) for e in FOUR}))
    [(first, _, refused, _, _)] = shared.grants.take_outbox()
    shared.grants.answer(first, 0, 16000.0)  # the room it was released onto was taken by another picker
    await asyncio.sleep(0)
    assert not answer.done() and handler.control.admission.queued("c") == 1, "back in the queue, not a 429"
    handler.control.tick()  # any release (a completion, a sample, housekeeping) looks again
    [(second, _, other, _, _)] = shared.grants.take_outbox()
    assert other != refused
    shared.grants.answer(second, 5, 0.0)
    response = pb.ProcessingResponse.FromString(await asyncio.wait_for(answer, 1.0))
    assert not response.HasField("immediate_response") and shared.inflight.endpoints.get(other) == 1


def test_the_others_load_freed_is_a_drop_in_an_endpoints_memory_or_a_clusters_requests():
    busy = others_of({("c", A): (2, 2.0, 16000.0), ("c", B): (1, 1.0, 0.0)}, {"c": (3, 3.0)}, {}, {})
    assert not freed(busy, busy)
    more = others_of({("c", A): (3, 3.0, 24000.0), ("c", B): (1, 1.0, 0.0)}, {"c": (4, 4.0)}, {}, {})
    assert not freed(busy, more) and freed(more, busy)
    assert freed(busy, others_of({("c", A): (2, 2.0, 8000.0)}, {"c": (3, 3.0)}, {}, {})), "memory"
    assert freed(busy, others_of({("c", A): (2, 2.0, 16000.0)}, {"c": (2, 2.0)}, {}, {})), "a slot"


async def test_a_view_that_shows_another_pickers_request_ended_releases_a_request_waiting_for_memory():
    handler, shared = contended_handler(free=20000.0, admission=Admission(4, 1.0, retry_after_s=1))
    assert shared.free.get(A) == 20000.0  # the samples' baseline: the others had nothing there then
    held = {("c", e): (2, 2.0, 16000.0) for e in FOUR}
    shared.set_others(others_of(held, {"c": (8, 8.0)}, {}, {}, pickers=3))  # since: 16000 MiB on each
    answer = handler.control.route(headers(x_session_id=b"s1", x_mib=b"8000"), handler.holder.current, NO_BODY,
                                   "request_headers")
    assert handler.control.admission.queued("c") == 1 and not shared.grants.outbox, "no endpoint has the memory: queued"
    before = shared.others
    shared.set_others(others_of(held, {"c": (8, 8.0)}, {}, {}, pickers=3))  # a view: nothing ended
    handler.control.others_changed(before)
    assert handler.control.admission.queued("c") == 1 and not shared.grants.outbox
    before = shared.others
    shared.set_others(others_of({**held, ("c", B): (0, 0.0, 0.0)}, {"c": (6, 6.0)}, {}, {}, pickers=3))
    handler.control.others_changed(before)  # another picker's requests on B ended: tried again now, onto B
    [(request_id, _, endpoint, _, _)] = shared.grants.take_outbox()
    assert endpoint == B and handler.control.admission.queued("c") == 0
    shared.grants.answer(request_id, 7, 0.0)
    response = pb.ProcessingResponse.FromString(await asyncio.wait_for(answer, 1.0))
    assert not response.HasField("immediate_response") and shared.inflight.endpoints.get(B) == 1


def test_a_granted_request_wakes_the_report_loop_and_the_next_report_takes_note():
    """A grant's pick is news to the other pickers: reported at the next tick, it came just after the
    grant request's own report, so it waited out the whole interval while they routed onto its
    endpoint (the lab's multi_gateway: 429 of 679 co-locations within 10 ms of another gateway's pick).
    A refusal is no pick: no wake."""
    grants = Grants()
    woken = []
    grants.wake = lambda: woken.append(grants.granted)
    answers = []
    refused = grants.ask("c", A, 8000.0, 100.0, lambda g, u: answers.append(g))
    granted = grants.ask("c", A, 8000.0, 100.0, lambda g, u: answers.append(g))
    woken.clear()
    grants.answer(refused, 0, 9000.0)
    assert not grants.granted and woken == []
    grants.answer(granted, 7, 0.0)
    assert answers == [0, 7] and grants.granted and woken == [True]
    report_message(InFlight(), "p", 1, 0.0, grants)
    assert not grants.granted, "the report took note of it"


async def test_a_granted_pick_reaches_the_control_plane_at_once_not_at_the_next_tick():
    """With a report interval far longer than the test (5 s), the request committed on its grant is in
    the control plane's sum within a second: the report loop sent it when the grant came."""
    table = LoadTable(expiry_s=60.0)
    one, two = SharedLoad(InFlight()), SharedLoad(InFlight())
    for shared in (one, two):
        shared.inflight.picked("c", B)  # traffic before the first reports: each decides for the other
    async with load_view_server(table) as target:
        tasks = [asyncio.create_task(run_load_view(target, name, shared, 5.0, 60.0))
                 for name, shared in (("one", one), ("two", two))]
        try:
            await until(lambda: one.others.pickers == 2 and one.others.idle == 0 and one.grants.view > 0)
            answers: list[int | None] = []

            def commit(grant: int | None, unseen: float) -> None:
                answers.append(grant)
                one.inflight.picked("c", A, mib=16000.0)

            one.grants.ask("c", A, 16000.0, 4000.0, commit)
            await until(lambda: answers == [1], seconds=1.0)
            await until(lambda: ("c", A) in table.report("one").endpoints, seconds=1.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
