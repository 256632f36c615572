"""The scheduler's rules, one by one: weighted bound, memory admission, spill and pin move, prefix keys,
the cost model, the first burst (issue 15 item 1) and failing endpoints (issue 15 item 13)."""

from __future__ import annotations

import json
import random

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.accesslog.v3 import als_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.body import NO_BODY as NO_BODY_FIELDS
from ext_proc.body import BodyFields, body_fields, prefix_hash
from ext_proc.costmodel import CostModel
from ext_proc.handler import PickerHandler
from ext_proc.inflight import InFlight, MemorySamples
from ext_proc.picker import pick, request_need
from ext_proc.ring import HashRing
from ext_proc.scheduling import build_profile
from ext_proc.scheduling.plugins.bounded_load import under_bound
from ext_proc.sessions import SessionTable, pin_after
from ext_proc.transport.base import StreamState
from ext_proc.view import ClusterEndpoints, EndpointView, RequestClass, RoutingTable, ServiceRoute, ViewHolder
from tests.unit.ext_proc.test_scheduling_equivalence import new_choose


def choose(p, position, pinned, loads, total, work=1.0, need_mib=0.0, free_mib=None, failed=frozenset(),
           load_factor=1.25, margin=0.2, request_id=b"", min_bound=0.0, pinned_load_factor=None, affinity_slack=None):
    """``(endpoint, outcome)`` of the default profile's rules on a hand-made case: ``bounded-load`` with
    ``load_factor``, ``min_bound`` and ``pinned_load_factor`` (None: ``load_factor``), ``affinity-slack``
    with ``affinity_slack`` when it is set."""
    return new_choose(p, position, pinned, loads, total, work, need_mib, free_mib, failed, load_factor, margin,
                      request_id, min_bound, pinned_load_factor or load_factor, affinity_slack)

FOUR = [f"10.0.0.{i}:8000" for i in range(4)]


def pool(endpoints=FOUR, weights=None, classes=None) -> ClusterEndpoints:
    return ClusterEndpoints("c", tuple(endpoints), HashRing(endpoints), 0, weights or {}, classes or {})


def cla(name: str, weights: dict[str, int], classes: dict[str, str] | None = None):
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    locality = assignment.endpoints.add()
    for address, w in weights.items():
        host, port = address.rsplit(":", 1)
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.load_balancing_weight.value = w
        if classes:
            lb.metadata.filter_metadata["inferlb"].update({"gpu_class": classes[address]})
    return assignment


ROUTING = RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity="soft"),),
                       body_max_bytes=1 << 20)


def view(weights=None, routing=ROUTING, classes=None) -> EndpointView:
    return EndpointView.build({"c": cla("c", weights or {e: 1 for e in FOUR}, classes)}, routing)


def headers(**kw: bytes) -> dict[str, bytes]:
    return {":authority": b"x", **{k.replace("_", "-"): v for k, v in kw.items()}}


# --- weighted bounded loads ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=2, max_size=8), st.floats(1.0, 3.0),
       st.lists(st.floats(0.0, 30.0), min_size=8, max_size=8), st.floats(0.05, 5.0))
def test_some_endpoint_is_always_under_its_weighted_bound(weights, c, loads, work):
    endpoints = [f"10.0.0.{i}:8000" for i in range(len(weights))]
    p = pool(endpoints, dict(zip(endpoints, weights, strict=True)))
    load = dict(zip(endpoints, loads[:len(endpoints)], strict=True))
    total = sum(load.values())
    assert any(under_bound(load[e], total, work, p.shares[e], c) for e in endpoints)
    chosen, reason = choose(p, random.Random(0).getrandbits(64), None, load, total, work, load_factor=c)
    assert chosen is not None and reason in ("affinity", "spilled")
    assert under_bound(load[chosen], total, work, p.shares[chosen], c)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=2, max_size=6), st.integers(0, 2**32))
def test_a_burst_on_one_key_splits_by_weight_within_the_bound(weights, seed):
    """N requests of one session (no completions): each endpoint holds at most c x N x w_i / sum(w) + 1."""
    endpoints = [f"10.0.0.{i}:8000" for i in range(len(weights))]
    p = pool(endpoints, dict(zip(endpoints, weights, strict=True)))
    live = InFlight()
    position = random.Random(seed).getrandbits(64)
    n = 200
    for _ in range(n):
        e, _ = choose(p, position, None, live.work, live.cluster_work.get("c", 0.0), 1.0)
        live.picked("c", e)
    for e in endpoints:
        assert live.endpoints.get(e, 0) <= 1.25 * n * p.shares[e] + 1


def test_an_a10_gets_its_weight_share_of_pinned_traffic():
    """The ring ignores weights; the bound does not: 8 A100 (w 100) vs 1 A10 (w 25) sessions hashing anywhere."""
    endpoints = [f"10.0.0.{i}:8000" for i in range(3)]
    weights = {endpoints[0]: 100, endpoints[1]: 100, endpoints[2]: 25}
    v = view(weights)
    handler = PickerHandler(ViewHolder(v))
    for i in range(450):
        handler.process(StreamState(), _headers_msg(x_session_id=b"s%d" % i))
    counts = handler.control.inflight.endpoints
    assert counts[endpoints[2]] <= 1.25 * 450 * 25 / 225 + 1
    assert counts[endpoints[0]] > 2 * counts[endpoints[2]]


# --- memory admission ----------------------------------------------------------------------------


@pytest.mark.parametrize(("free", "admitted"), [(2457.6, True), (2457.5, False), (10_000.0, True)])
def test_memory_admission_needs_the_request_plus_20_percent(free, admitted):
    p = pool(FOUR[:1])
    chosen, reason = choose(p, None, None, {}, 0.0, 1.0, 2048.0, {FOUR[0]: free})
    assert (chosen is not None) == admitted
    assert reason == ("least-loaded" if admitted else "no-memory")


def test_estimated_free_subtracts_what_was_sent_since_the_sample_and_credits_completions():
    clock = [100.0]
    live = InFlight(clock=lambda: clock[0])
    live.picked("c", FOUR[0], mib=1000.0)  # before the sample: the sample already counts it
    clock[0] = 101.0
    live.set_samples(MemorySamples.of({FOUR[0]: (8000.0, 100.5)}))
    assert live.free[FOUR[0]] == 8000.0
    live.picked("c", FOUR[0], mib=3000.0)  # after the sample
    assert live.free[FOUR[0]] == 5000.0
    # a new sample from before that pick: still subtracted
    live.set_samples(MemorySamples.of({FOUR[0]: (7900.0, 100.5)}))
    assert live.free[FOUR[0]] == 4900.0
    live.completed("c", FOUR[0])  # the first (pre-sample) request ends: its memory is free again
    assert live.free[FOUR[0]] == 5900.0


def test_a_sample_is_credited_with_the_requests_it_saw_that_finished_since():
    clock = [100.0]
    live = InFlight(clock=lambda: clock[0], arrival_slack_s=0.05, completion_lag_s=0.05)
    live.picked("c", FOUR[0], mib=8000.0)
    live.picked("c", FOUR[0], mib=8000.0)
    live.set_samples(MemorySamples.of({FOUR[0]: (24000.0, 99.0)}))
    clock[0] = 100.5  # the sample (taken at 100.2, 8000 free) arrives after both requests ended
    live.completed("c", FOUR[0])
    live.completed("c", FOUR[0])
    clock[0] = 101.0
    live.set_samples(MemorySamples.of({FOUR[0]: (8000.0, 100.2)}))
    assert live.free[FOUR[0]] == 24000.0  # not 8000: the memory it showed in use is free again


def test_doubtful_requests_near_the_sample_time_count_against_admission():
    clock = [100.0]
    live = InFlight(clock=lambda: clock[0], arrival_slack_s=0.05, completion_lag_s=0.05)
    live.picked("c", FOUR[0], mib=8000.0)
    clock[0] = 100.23  # finished 30 ms after the sample: maybe before it, as far as the picker knows
    live.completed("c", FOUR[0])
    clock[0] = 100.18  # picked 20 ms before the sample: maybe not at the backend yet
    live.picked("c", FOUR[0], mib=4000.0)
    clock[0] = 100.6
    live.set_samples(MemorySamples.of({FOUR[0]: (16000.0, 100.2)}))
    assert live.free[FOUR[0]] == 12000.0  # no credit for the first, the second subtracted


def test_an_expired_pick_is_never_credited_to_a_sample():
    clock = [0.0]
    live = InFlight(expiry_s=10.0, clock=lambda: clock[0])
    live.set_samples(MemorySamples.of({FOUR[0]: (20000.0, 0.0)}))
    live.picked("c", FOUR[0], mib=8000.0)
    clock[0] = 11.0
    live.expire()  # its record was lost: when it ended is unknown
    live.set_samples(MemorySamples.of({FOUR[0]: (20000.0, 10.5)}))
    assert live.free[FOUR[0]] == 20000.0


ARRIVAL, LAG = 0.05, 0.05  # InFlight's default arrival_slack_s and completion_lag_s


def _replay(spans, size, taken_at, delay, clock=None):
    """Requests of ``size`` MiB each on one endpoint: picked at ``t``, at the endpoint up to ``ARRIVAL`` s
    later, holding memory there for ``d`` s, their completion reaching the picker up to ``LAG`` s after
    that; replayed into an :class:`InFlight` until ``taken_at + delay`` (when the sample arrives).
    Returns ``(the InFlight, the requests as (picked, arrived, ended, completion learned), the
    endpoint's whole memory, requests it held at taken_at, the truth now)``; ``clock``: the one-item
    list the InFlight's clock reads (a new one when None)."""
    requests = [(t, t + ARRIVAL * a, t + ARRIVAL * a + d, t + ARRIVAL * a + d + LAG * lag)
                for t, d, a, lag in spans]
    total = 30 * 8192.0
    now = taken_at + delay
    events = sorted([(p, "pick", i) for i, (p, _, _, _) in enumerate(requests)]
                    + [(f, "done", i) for i, (_, _, _, f) in enumerate(requests)])
    clock = [0.0] if clock is None else clock
    live = InFlight(expiry_s=1000.0, clock=lambda: clock[0])
    live.set_samples(MemorySamples.of({FOUR[0]: (total, -1.0)}))  # known from the start
    for t, kind, _ in events:
        if t > now:
            break
        clock[0] = t
        if kind == "pick":
            live.picked("c", FOUR[0], mib=size)
        else:
            live.completed("c", FOUR[0])
    clock[0] = now
    held = sum(1 for _, a, e, _ in requests if a <= taken_at < e)
    truth = total - sum(size for p, _, e, _ in requests if p <= now < e)
    return live, requests, total, held, truth


_SPANS = st.lists(st.tuples(st.floats(0, 10), st.floats(0.001, 3), st.floats(0, 1), st.floats(0, 1)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(_SPANS, st.sampled_from([2048.0, 8192.0]), st.floats(0.5, 10), st.floats(0, 2))
def test_the_memory_estimate_never_exceeds_the_truth(spans, size, taken_at, delay):
    """A true sample at ``taken_at`` reaches the picker ``delay`` s later (:func:`_replay`). The
    estimate then is at most the true free memory (less every request picked and not ended), and
    equal to it when no request is doubtful: none picked within ``ARRIVAL`` before the sample, none
    running at the sample's time or after it whose completion came within ``LAG`` after it, none whose
    completion is still on its way. (One size: Envoy's completions are matched to picks first in,
    first out, so a request picked after the sample that finished quickly can lend its completion's
    time to an older one the sample held: see the next test.)"""
    live, requests, total, held, truth = _replay(spans, size, taken_at, delay)
    live.set_samples(MemorySamples.of({FOUR[0]: (total - held * size, taken_at)}))
    assert live.free[FOUR[0]] <= truth + 1e-6
    now = taken_at + delay
    doubtful = any(taken_at - ARRIVAL < p <= taken_at or (e > taken_at and f <= taken_at + LAG) or e <= now < f
                   for p, a, e, f in requests)
    if not doubtful:
        assert live.free[FOUR[0]] == pytest.approx(truth)


@settings(max_examples=300, deadline=None)
@given(_SPANS, st.sampled_from([2048.0, 8192.0]), st.floats(0.5, 10), st.floats(0, 2))
def test_the_backends_count_of_held_requests_settles_the_doubtful_ones_and_never_overshoots(
        spans, size, taken_at, delay):
    """The same replay with the backend's true count of the requests it held in the sample
    (``picker.memory_count_in_sample``): the estimate stays at most the truth, is never below the
    estimate without the count, and equals the truth whenever no request's completion is still on
    its way (then every request the sample held is one the picker knows as held or doubtful)."""
    live, requests, total, held, truth = _replay(spans, size, taken_at, delay)
    without, _, _, _, _ = _replay(spans, size, taken_at, delay)
    sample = {FOUR[0]: (total - held * size, taken_at)}
    live.set_samples(MemorySamples.of(sample, {FOUR[0]: float(held)}))
    without.set_samples(MemorySamples.of(sample))
    assert without.free[FOUR[0]] - 1e-6 <= live.free[FOUR[0]] <= truth + 1e-6
    now = taken_at + delay
    if not any(e <= now < f for _, _, e, f in requests):
        assert live.free[FOUR[0]] == pytest.approx(truth)


@settings(max_examples=300, deadline=None)
@given(_SPANS, st.sampled_from([2048.0, 8192.0]), st.integers(0, 29), st.floats(0, LAG), st.floats(0, 0.2),
       st.booleans())
def test_the_estimate_stays_at_most_the_truth_as_completions_arrive_after_a_young_sample(
        spans, size, k, after_end, delay, counted):
    """A true sample taken ``after_end`` s after one request ended (the ``k``-th, modulo) reaches the
    picker ``delay`` s later (:func:`_replay`; often less than ``LAG``, as when the slow loop reads a
    scrape at once); the picks and completions that follow move the estimate: it stays at most the
    true free memory at every one of them, with or without the backend's count. A request that ended
    just before a young sample is free in it while its completion is still on its way: its completion
    must not be credited on top."""
    taken_at = 1.0
    if spans:
        t, d, a, _ = spans[k % len(spans)]
        taken_at = t + ARRIVAL * a + d + after_end
    clock = [0.0]
    live, requests, total, held, _ = _replay(spans, size, taken_at, delay, clock)
    live.set_samples(MemorySamples.of({FOUR[0]: (total - held * size, taken_at)},
                                      {FOUR[0]: float(held)} if counted else None))
    now = taken_at + delay
    later = sorted([(p, "pick", i) for i, (p, _, _, _) in enumerate(requests) if p > now]
                   + [(f, "~done", i) for i, (_, _, _, f) in enumerate(requests) if f > now])  # picks first
    picked = {i for i, (p, _, _, _) in enumerate(requests) if p <= now}
    for t, kind, i in later:
        clock[0] = t
        if kind == "pick":
            live.picked("c", FOUR[0], mib=size)
            picked.add(i)
        else:
            live.completed("c", FOUR[0])
        truth = total - size * sum(1 for j in picked if t < requests[j][2])
        assert live.free[FOUR[0]] <= truth + 1e-6


@pytest.mark.parametrize("counted", [False, True])
def test_a_completion_of_a_request_free_in_a_young_sample_is_not_credited_twice(counted):
    """Found in the lab's ``uneven`` scenario (OOM 0.52 %): two 8 GiB requests picked before a sample
    read the moment it was taken; the first ended 1 ms before it, its completion on its way (Envoy's
    access-log flush). The sample shows one held (16 GiB free of 24). Crediting that completion
    again made it 24 GiB, then 32 when the second ended, and an 18 GiB request went there: OOM."""
    clock = [0.0]
    live = InFlight(clock=lambda: clock[0])
    live.set_samples(MemorySamples.of({FOUR[0]: (24576.0, 0.0)}))
    for at in (19.583, 19.742):
        clock[0] = at
        live.picked("c", FOUR[0], mib=8192.0)
    clock[0] = 20.0  # the sample (the first ended at 19.999) arrives at once
    live.set_samples(MemorySamples.of({FOUR[0]: (16384.0, 20.0)}, {FOUR[0]: 1.0} if counted else None))
    assert live.free[FOUR[0]] == 16384.0
    clock[0] = 20.004  # the first's completion: its memory was already free in the sample
    live.completed("c", FOUR[0])
    assert live.free[FOUR[0]] == 16384.0
    clock[0] = 20.1  # the second ends after the lag: certainly held in the sample
    live.completed("c", FOUR[0])
    assert live.free[FOUR[0]] == 24576.0


def test_a_count_that_holds_another_pickers_requests_is_not_used_while_that_picker_decides():
    """Two requests this picker sent 10 ms before the sample are doubtful (4096 MiB each). The count
    says the backend held 2 requests: alone in the view, the picker takes them as held; once another
    picker with traffic is in the view (the 2 may be its own), and before the first view, the
    doubtful ones count against admission again."""
    from ext_proc.shared_load import others_of

    clock = [0.0]
    handler = PickerHandler(ViewHolder(view()))
    handler.control.inflight = InFlight(clock=lambda: clock[0])
    shared = handler.control.share_load()
    for _ in range(2):
        clock[0] = 9.99
        handler.control.inflight.picked("c", FOUR[0], mib=4096.0)
    clock[0] = 10.5
    samples = {FOUR[0]: (20480.0, 10.0)}

    def estimate() -> float:
        handler.control.set_samples(MemorySamples.of(dict(samples), {FOUR[0]: 2.0}))
        return handler.control.inflight.free[FOUR[0]]

    assert estimate() == 20480.0 - 2 * 4096.0, "no view yet: the count is not used"
    shared.set_others(others_of({}, {}, {}, {}, pickers=2, idle=1))
    assert estimate() == 20480.0, "alone: both were held in the sample"
    shared.set_others(others_of({}, {}, {}, {}, pickers=2, idle=0))
    assert estimate() == 20480.0 - 2 * 4096.0, "another picker decides: the count may hold its requests"


def test_a_quick_request_after_the_sample_lends_its_completion_time_to_an_older_one():
    """Hypothesis found it: A is picked at 7 s and runs until 10 s (its completion learned at
    10.05 s); B is picked at 10 s and done at 10.016 s. Matched first in, first out, the first
    completion (B's, 47 ms after the 9.969 s sample) ends A's pick, which then looks maybe freed
    before the sample: no credit, and the estimate errs low by one request, never high."""
    clock = [0.0]
    live = InFlight(expiry_s=1000.0, clock=lambda: clock[0])
    live.set_samples(MemorySamples.of({FOUR[0]: (20480.0, -1.0)}))
    for at, kind in ((7.0, "pick"), (10.0, "pick"), (10.015625, "done"), (10.05, "done")):
        clock[0] = at
        if kind == "pick":
            live.picked("c", FOUR[0], mib=2048.0)
        else:
            live.completed("c", FOUR[0])
    clock[0] = 10.96875
    live.set_samples(MemorySamples.of({FOUR[0]: (20480.0 - 2048.0, 9.96875)}))  # A held memory then
    assert live.free[FOUR[0]] == 20480.0 - 2048.0  # the truth is 20480: both have ended


def test_a_declared_need_gets_no_margin_an_estimated_one_does():
    routing = RoutingTable(services=ROUTING.services, request_memory_header="x-sim-memory-mib")
    v = view(routing=routing)
    free = InFlight()
    free.set_samples(MemorySamples.of({e: (8192.0, 0.0) for e in FOUR}))
    declared = pick(headers(x_sim_memory_mib=b"8192"), v, free)
    assert declared.endpoint is not None and declared.reason != "no-memory"
    estimated = pick(headers(), v, free, body=BodyFields(prompt_tokens=16256.0, max_tokens=128))  # 8192 MiB
    assert estimated.mib == 8192.0 and estimated.reason == "no-memory"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 40_000), min_size=4, max_size=4), st.floats(0, 20_000))
def test_a_chosen_endpoint_always_has_memory_for_the_request(frees, need):
    free = dict(zip(FOUR, frees, strict=True))
    for position in (None, 12345, 2**63):
        chosen, reason = choose(pool(), position, None, {}, 0.0, 1.0, need, free)
        if chosen is None:
            assert reason == "no-memory" and all(f < need * 1.2 for f in frees)
        else:
            assert free[chosen] >= need * 1.2


def test_a_session_whose_endpoint_lacks_memory_spills_for_memory():
    p = pool()
    home, _ = choose(p, 42, None, {}, 0.0)
    chosen, reason = choose(p, 42, home, {}, 0.0, 1.0, 4000.0, {home: 100.0})
    assert chosen != home and reason == "memory"


def test_request_need_from_header_body_class_or_default():
    routing = RoutingTable(request_memory_header="x-sim-memory-mib", kv_mib_per_token=0.5,
                           request_classes={"big": RequestClass(18432.0, 2000, 512)})
    assert request_need({"x-sim-memory-mib": b"8192"}, routing, BodyFields()) == (8192.0, None, None, True)
    assert request_need({}, routing, BodyFields(prompt_tokens=1000.0, max_tokens=200)) == (600.0, 1000.0, 200.0,
                                                                                          False)
    assert request_need({}, routing, BodyFields(prompt_tokens=100.0)) == (114.0, 100.0, 128.0, False)
    assert request_need({"x-inferlb-request-class": b"big"}, routing, BodyFields()) == (18432.0, 2000, 512, False)
    assert request_need({"x-inferlb-request-class": b"nope"}, routing, BodyFields()) == (2048.0, None, None, False)
    assert request_need({"x-sim-memory-mib": b"lots"}, routing, BodyFields())[0] == 2048.0  # bad value: ignored


async def test_a_request_nothing_can_hold_waits_then_gets_429_saying_why():
    from ext_proc.admission import Admission
    v = view({FOUR[0]: 1})
    handler = PickerHandler(ViewHolder(v), admission=Admission(4, 0.05, 2), limit_concurrency=False)
    handler.control.set_samples(MemorySamples.of({FOUR[0]: (1000.0, 0.0)}))
    answer, end = handler.process(StreamState(), _headers_msg())  # needs 2048 MiB + 20 %
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    response = pb.ProcessingResponse.FromString(await answer)
    assert response.immediate_response.status.code == 429
    assert "2048 MiB of GPU memory" in json.loads(response.immediate_response.body)["error"]["message"]


async def test_a_waiting_request_goes_once_a_sample_shows_memory():
    from ext_proc.admission import Admission
    v = view({FOUR[0]: 1})
    handler = PickerHandler(ViewHolder(v), admission=Admission(4, 2.0, 1), limit_concurrency=False)
    handler.control.set_samples(MemorySamples.of({FOUR[0]: (1000.0, 0.0)}))
    answer, _ = handler.process(StreamState(), _headers_msg())
    assert not answer.done()
    handler.control.set_samples(MemorySamples.of({FOUR[0]: (30_000.0, 0.0)}))
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    response = pb.ProcessingResponse.FromString(await answer)
    assert response.WhichOneof("response") == "request_headers"


# --- spill and pin moves -------------------------------------------------------------------------


def test_an_over_bound_preferred_endpoint_spills_clockwise():
    p = pool()
    home, reason = choose(p, 7, None, {}, 0.0)
    assert reason == "affinity"
    loads = {home: 10.0}
    chosen, reason = choose(p, 7, None, loads, 10.0)
    assert reason == "spilled" and chosen != home
    owners = p.ring.owners
    i = p.ring.start_index(7)
    walk = []
    for k in range(len(owners)):
        e = owners[(i + k) % len(owners)]
        if e not in walk:
            walk.append(e)
    assert chosen == walk[1]  # the next distinct endpoint clockwise


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=30), st.integers(1, 5))
def test_a_pin_moves_only_after_move_after_spills_in_a_row(spilled, move_after):
    pin, spills, moves = "a", 0, 0
    run = 0
    for s in spilled:
        chosen, reason = ("b" if pin == "a" else "a", "spilled") if s else (pin, "affinity")
        new, spills, moved = pin_after(pin, chosen, reason, spills, move_after)
        run = run + 1 if s else 0
        assert moved == (s and run == move_after)
        if moved:
            run = 0
            moves += 1
        assert new == (chosen if moved else pin)
        pin = new
    assert moves <= len(spilled) // move_after


def test_a_burst_does_not_scatter_a_session_but_a_persistent_spill_moves_it():
    v = view()
    handler = PickerHandler(ViewHolder(v), pin_move_after=3)
    answer = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"alice"))[0])
    slot = next(iter(handler.control.sessions._entries))
    assert handler.control.sessions.get(slot) == answer
    # The home endpoint is hot (other traffic): the next 2 requests spill, the pin stays.
    for _ in range(10):
        handler.control.inflight.picked("c", answer, 1.0)
    for _ in range(2):
        other = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"alice"))[0])
        assert other != answer and handler.control.sessions.get(slot) == answer
    third = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"alice"))[0])
    assert handler.control.sessions.get(slot) == third != answer  # moved, and counted as pin-moved


# --- prefix keys ---------------------------------------------------------------------------------


CHAT = {"model": "v1", "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                                    {"role": "user", "content": "Tell me about GPUs."}]}


def test_prefix_keys_are_deterministic_and_ignore_later_turns():
    a = prefix_hash(CHAT, 2, 4096)
    longer = {**CHAT, "messages": CHAT["messages"] + [{"role": "assistant", "content": "Sure."},
                                                      {"role": "user", "content": "More."}]}
    assert a == prefix_hash(json.loads(json.dumps(CHAT)), 2, 4096) == prefix_hash(longer, 2, 4096)
    other = {**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": "Something else"}]}
    assert prefix_hash(other, 2, 4096) != a
    assert prefix_hash(other, 1, 4096) == prefix_hash(CHAT, 1, 4096)  # same system prompt
    assert prefix_hash({"prompt": "x" * 10_000}, 2, 100) == prefix_hash({"prompt": "x" * 100 + "y"}, 2, 100)
    assert prefix_hash({"input": 1}, 2, 100) is None and prefix_hash(CHAT, 0, 100) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=200)), max_size=5))
def test_prefix_key_is_a_function_of_the_leading_messages_only(messages):
    doc = {"messages": [{"role": r, "content": c} for r, c in messages]}
    again = json.loads(json.dumps(doc))
    assert prefix_hash(doc, 2, 4096) == prefix_hash(again, 2, 4096)
    extended = {"messages": doc["messages"] + [{"role": "user", "content": "later"}]}
    if len(messages) >= 2:
        assert prefix_hash(extended, 2, 4096) == prefix_hash(doc, 2, 4096)


def test_requests_sharing_a_prefix_prefer_one_endpoint_across_processes():
    body = json.dumps(CHAT).encode()
    fields = body_fields(body, ROUTING)
    assert fields.prefix is not None and fields.prompt_tokens == pytest.approx(len(
        CHAT["messages"][0]["content"] + CHAT["messages"][1]["content"]) / 4)
    first = {pick(headers(), view(), None, None, fields).endpoint for _ in range(3)}
    other_process = {pick(headers(), EndpointView.build({"c": cla("c", {e: 1 for e in FOUR})}, ROUTING), None,
                          None, body_fields(body, ROUTING)).endpoint for _ in range(3)}
    assert len(first) == 1 and first == other_process
    assert pick(headers(), view(), None, None, fields).key == "prefix"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([{}, {"x-session-id": b"alice"}, {"x-session-id": b""}]),
       st.sampled_from([{}, {"user": "u1"}, {"user": ""}, {"prompt_cache_key": "c"}, {"user": 5}]),
       st.integers(0, 3), st.lists(st.integers(0, 3), max_size=12), st.booleans())
def test_a_request_with_a_session_key_decides_the_same_without_its_prefix_key(header, named, turns, loads, pinned):
    """The prefix key is not computed where a session key (header or body) places the request; every
    decision is the one the key computed anyway gave (the same endpoint, outcome and key kind)."""
    from ext_proc.picker import header_session_key
    doc = {**CHAT, **named, "messages": CHAT["messages"] + [{"role": "user", "content": "more"}] * turns}
    body = json.dumps(doc).encode()
    hs = headers(**header)
    routing = RoutingTable(services=ROUTING.services, body_max_bytes=1 << 20, prefix_cache_tokens=500_000)
    v = view(routing=routing)
    keyed = header_session_key(hs, routing) is not None
    lean = body_fields(body, routing, keyed)
    full = lean._replace(prefix=prefix_hash(doc, routing.prefix_messages, routing.prefix_max_bytes))
    assert full.prefix is not None
    body_key = any(isinstance(doc.get(k), str) and doc[k] for k in ("user", "prompt_cache_key"))
    assert lean.prefix == (None if keyed or body_key else full.prefix)
    live = {e: float(n) for e, n in zip(FOUR, loads, strict=False)}
    sessions = SessionTable()
    first = pick(hs, v, live, sessions, full)
    if pinned and first.session is not None and first.endpoint is not None:
        sessions.touch(first.session, first.endpoint)
    assert pick(hs, v, live, sessions, lean) == pick(hs, v, live, sessions, full)


def test_prompt_cache_key_is_a_session_key():
    fields = body_fields(json.dumps({**CHAT, "prompt_cache_key": "conv-9"}).encode(), ROUTING)
    d = pick(headers(), view(), None, SessionTable(), fields)
    assert d.key == "session" and d.session is not None


# --- cost model ----------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.floats(5, 200), st.floats(0, 500), st.floats(1, 100), st.integers(0, 2**32))
def test_the_cost_model_converges_to_the_true_coefficients(a, b, c, seed):
    """duration = a + b x prompt_k + c x output_k (+ 2 % noise) -> the fit is within 5 % of a typical request."""
    rng = random.Random(seed)
    model = CostModel(forget=1.0, min_samples=20)
    for _ in range(400):
        p, o = rng.uniform(0, 4000), rng.uniform(1, 1000)
        y = a + b * p / 1000 + c * o / 1000
        model.observe("a100", p, o, y * (1 + rng.uniform(-0.02, 0.02)), 0.3 * y)
    fit = model.refit()["a100"]
    for p, o in ((100, 10), (2000, 500), (4000, 1000)):
        truth = a + b * p / 1000 + c * o / 1000
        assert fit.predict_ms(p, o) == pytest.approx(truth, rel=0.05, abs=0.05 * fit.mean_ms)


def test_the_cost_model_forgets_old_behaviour():
    model = CostModel(forget=0.99, min_samples=20)
    rng = random.Random(1)
    for slope in (10.0, 100.0):  # the class became 10x slower per prompt token
        for _ in range(1000):
            p = rng.uniform(0, 4000)
            model.observe("a10", p, 100, 20 + slope * p / 1000)
    assert model.refit()["a10"].duration[1] == pytest.approx(100.0, rel=0.05)


def test_relative_work_is_1_until_ready_then_follows_the_fit():
    model = CostModel(min_samples=20)
    assert model.relative_work("a100", 4000, 1000) == 1.0
    rng = random.Random(2)
    for _ in range(50):
        o = rng.uniform(10, 1000)
        model.observe("a100", 100, o, 10 + 90 * o / 1000)
    model.refit()
    long, short = model.relative_work("a100", 100, 1000), model.relative_work("a100", 100, 10)
    assert long > 1.5 and short < 0.5
    assert model.relative_work("a100", None, 10) == 1.0 and model.relative_work("h100", 100, 10) == 1.0


def test_completions_teach_the_cost_model_through_the_access_log():
    v = view(classes={e: "a10" for e in FOUR})
    handler = PickerHandler(ViewHolder(v), costs=CostModel(min_samples=3))
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}).encode()
    for i in range(5):
        stream = StreamState()
        handler.process(stream, _headers_msg(end=False, content_type=b"application/json"))
        answer, _ = handler.process(stream, _body_msg(body))
        endpoint = _endpoint(answer, body=True)
        handler.access_log(_log(endpoint, duration_ms=100.0 + i, ttft_ms=20.0))
    handler.control.tick()
    fit = handler.control.costs.fits["a10"]
    assert fit.samples == 5 and fit.mean_ms == pytest.approx(102.0, rel=0.01)


# --- cost-aware affinity: the slack learned from what a miss and a request in flight cost -----------


@settings(max_examples=30, deadline=None)
@given(st.floats(5, 100), st.floats(1, 80), st.floats(0, 60), st.floats(5, 120), st.integers(0, 2**32))
def test_the_cost_model_learns_what_load_and_a_cache_miss_cost(d, m, e, a, seed):
    """duration = a + 20 p_k + 900 o_k + d x load, TTFT = 3 + 2 p_k + miss x (m + e p_k) (2 % noise):
    the fit finds d and the miss's cost, and the slack is their ratio."""
    rng = random.Random(seed)
    model = CostModel(forget=1.0, min_samples=20)
    for _ in range(600):
        p, o, load, miss = rng.uniform(0, 4000), rng.uniform(1, 100), rng.randint(0, 6), rng.random() < 0.3
        y = a + 20 * p / 1000 + 900 * o / 1000 + d * load
        ttft = 3 + 2 * p / 1000 + (m + e * p / 1000 if miss else 0.0)
        model.observe("a100", p, o, y * (1 + rng.uniform(-0.02, 0.02)), ttft * (1 + rng.uniform(-0.02, 0.02)),
                      load, miss)
    fit = model.refit()["a100"]
    assert fit.duration[3] == pytest.approx(d, rel=0.1, abs=1.0)
    for p in (100, 1000, 3000):
        truth = m + e * p / 1000
        assert fit.hit_saving_ms(p) == pytest.approx(truth, rel=0.1, abs=1.5)
        assert model.affinity_slack("a100", p) == pytest.approx(fit.hit_saving_ms(p) / (2 * fit.duration[3]))


def test_the_affinity_slack_is_unknown_until_hits_and_misses_were_both_seen():
    model = CostModel(min_samples=20)
    assert model.affinity_slack("a100", 1000) is None  # not ready
    for i in range(40):
        model.observe("a100", 1000, 16, 50.0 + 10 * (i % 3), 10.0, i % 3, False)  # every request a hit
    model.refit()
    assert model.fits["a100"].ttft is None and model.affinity_slack("a100", 1000) is None
    for i in range(10):
        model.observe("a100", 1000, 16, 50.0 + 10 * (i % 3), 40.0, i % 3, True)
    model.refit()
    assert model.affinity_slack("a100", 1000) == pytest.approx(30.0 / 20.0, rel=0.05)  # 30 ms saved, 10 ms a request
    assert model.affinity_slack("a100", None) is None and model.affinity_slack("h100", 1000) is None


def test_load_that_costs_nothing_leaves_the_slack_unbounded():
    model = CostModel(min_samples=20)
    for i in range(40):
        model.observe("a100", 1000, 16, 50.0, 40.0 if i % 2 else 10.0, i % 4, bool(i % 2))
    model.refit()
    assert model.affinity_slack("a100", 1000) == float("inf")


class _Slack(CostModel):
    """A cost model whose learned slack is 1 typical request per 500 prompt tokens."""

    def affinity_slack(self, gpu_class, prompt_tokens):
        return None if prompt_tokens is None else prompt_tokens / 500.0


class _Pinned:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def get(self, slot: int) -> str:
        return self.endpoint


def test_cost_aware_affinity_keeps_a_long_prompt_on_its_pin_and_spreads_a_short_one():
    from dataclasses import replace
    cost_aware = build_profile([{"plugin": "failed-endpoints"}, {"plugin": "memory-admission"},
                                {"plugin": "bounded-load"},
                                {"plugin": "affinity-slack", "params": {"slack": None, "cost_aware": True}},
                                {"plugin": "least-loaded"}, {"plugin": "ring-affinity"}])
    routing = replace(ROUTING, profiles={"default": cost_aware})
    v = view(routing=routing)
    home = v.clusters["c"].ring.lookup(b"s")
    loads = {home: 1.0}  # the pin has one request in flight, the others none: under its bound of 2
    long_, short = BodyFields(prompt_tokens=2000.0), BodyFields(prompt_tokens=100.0)
    d = pick(headers(x_session_id=b"s"), v, loads, _Pinned(home), long_, _Slack())
    assert (d.endpoint, d.reason) == (home, "affinity")  # slack 4: within 4 requests of the least loaded
    d = pick(headers(x_session_id=b"s"), v, loads, _Pinned(home), short, _Slack())
    assert d.endpoint != home and d.reason == "spilled"  # slack 0.2: one more request than an idle one is too many
    plain = view()  # the knob off: the bounded loads alone keep both
    assert pick(headers(x_session_id=b"s"), plain, loads, _Pinned(home), short, _Slack()).endpoint == home
    assert pick(headers(x_session_id=b"s"), v, loads, _Pinned(home), NO_BODY_FIELDS, _Slack()).endpoint == home


def test_a_pick_records_its_endpoint_load_and_whether_it_missed():
    flight = InFlight()
    flight.picked("c", FOUR[0], 1.5, prompt_tokens=10.0, output_tokens=5.0, miss=True)
    flight.picked("c", FOUR[0], 0.5, prompt_tokens=10.0, output_tokens=5.0, miss=False)
    first, second = flight.finish(FOUR[0]), flight.finish(FOUR[0])
    assert (first[7], first[8]) == (0.0, True) and (second[7], second[8]) == (1.5, False)


def test_a_completion_takes_its_own_pick_when_requests_finish_out_of_order():
    flight = InFlight()
    flight.picked("c", FOUR[0], 1.0, prompt_tokens=4000.0, output_tokens=5.0, request_id=b"long")
    flight.picked("c", FOUR[0], 1.0, prompt_tokens=10.0, output_tokens=5.0, request_id=b"short")
    assert flight.pop("c", FOUR[0], b"short")[3] == 10.0  # the younger one finished first
    assert flight.pop("c", FOUR[0], b"long")[3] == 4000.0
    flight.picked("c", FOUR[0], 1.0, request_id=b"a")
    flight.picked("c", FOUR[0], 1.0, request_id=b"b")
    assert flight.pop("c", FOUR[0], b"unknown")[9] == b"a"  # an id it does not know: the oldest
    assert flight.endpoints == {FOUR[0]: 1}


def test_a_session_kept_on_its_pin_teaches_the_cost_model_a_hit():
    seen: list[tuple[float, bool]] = []

    class Recorder(CostModel):
        def observe(self, gpu_class, prompt_tokens, output_tokens, duration_ms, ttft_ms=None, load=0.0, miss=True,
                    uncached=None):
            seen.append((load, miss))

    handler = PickerHandler(ViewHolder(view(classes={e: "a10" for e in FOUR})), costs=Recorder())
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}).encode()
    for _ in range(2):
        stream = StreamState()
        handler.process(stream, _headers_msg(end=False, content_type=b"application/json", x_session_id=b"s"))
        endpoint = _endpoint(handler.process(stream, _body_msg(body))[0], body=True)
        handler.access_log(_log(endpoint, duration_ms=100.0, ttft_ms=20.0))
    assert seen == [(0.0, True), (0.0, False)]  # a new session misses; its next turn, kept on its pin, hits


# --- issue 15 item 1: the first burst is load-bounded from the first request ---------------------


def test_the_first_burst_before_any_access_log_stream_is_bounded():
    """50 new sessions that all hash to one endpoint, no access-log stream open: <= the bound each."""
    v = view()
    handler = PickerHandler(ViewHolder(v))
    assert handler.control.inflight.streams == 0
    p = v.clusters["c"]
    home = p.ring.lookup(b"k-0")
    keys = [b"k-%d" % i for i in range(5000) if p.ring.lookup(b"k-%d" % i) == home][:50]
    assert len(keys) == 50
    for k in keys:
        handler.process(StreamState(), _headers_msg(x_session_id=k))
    counts = handler.control.inflight.endpoints
    assert max(counts.values()) <= 16 and sum(counts.values()) == 50


# --- issue 15 item 13: a failing endpoint is not pinned, its sessions re-pin once ----------------


def test_a_connect_failure_stops_pinning_there_and_re_pins_the_session_once():
    clock = [0.0]
    v = view()
    handler = PickerHandler(ViewHolder(v), inflight=InFlight(clock=lambda: clock[0], failure_hold_s=5.0))
    first = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"bob"))[0])
    survivor = next(e for e in FOUR if e != first)
    handler.access_log(_log(first, served_by=survivor, attempts=2))  # Envoy retried elsewhere: a 5xx, or broken?
    assert first not in handler.control.inflight.failed
    clock[0] = 1.0
    handler.access_log(_log(first, served_by=survivor, attempts=2))  # again within the hold: failing
    assert first in handler.control.inflight.failed
    seen = set()
    for _ in range(3):  # one after the other, each completed before the next
        e = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"bob"))[0])
        handler.control.inflight.completed("c", e)
        seen.add(e)
    assert first not in seen and len(seen) == 1  # re-pinned once, and it stays there
    clock[0] = 7.0
    handler.control.tick()
    assert first not in handler.control.inflight.failed
    again = _endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"bob"))[0])
    assert again in seen  # the hold is over, but the session stays on its new endpoint


def test_retries_elsewhere_far_apart_never_mark_an_endpoint_failing():
    clock = [0.0]
    handler = PickerHandler(ViewHolder(view()), inflight=InFlight(clock=lambda: clock[0], failure_hold_s=5.0))
    for _ in range(4):
        handler.access_log(_log(FOUR[0], served_by=FOUR[1], attempts=2))  # an OOM answer retried, say
        clock[0] += 6.0
        handler.control.tick()
        assert not handler.control.inflight.failed


def test_when_every_endpoint_is_failing_requests_are_still_pinned_not_refused():
    handler = PickerHandler(ViewHolder(view()))
    for e in FOUR:
        handler.access_log(_log(e, flag="upstream_connection_failure", status=503))
    assert set(handler.control.inflight.failed) == set(FOUR)
    decision = pick(headers(x_session_id=b"s"), handler.holder.current, handler.control.inflight)
    assert decision.endpoint in FOUR and decision.reason != "no-memory"


def test_upstream_connection_failure_flag_marks_the_pin_failing():
    handler = PickerHandler(ViewHolder(view()))
    e = _endpoint(handler.process(StreamState(), _headers_msg())[0])
    handler.access_log(_log(e, flag="upstream_connection_failure", status=503))
    assert e in handler.control.inflight.failed


# --- helpers -------------------------------------------------------------------------------------


def _headers_msg(end: bool = True, **kw: bytes) -> bytes:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    values = {":authority": b"x", ":path": b"/v1/chat/completions",
              **{k.replace("_", "-"): v for k, v in kw.items()}}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]), end_of_stream=end)
    ).SerializeToString()


def _body_msg(body: bytes) -> bytes:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()


def _endpoint(answer: bytes, body: bool = False) -> str:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    r = pb.ProcessingResponse.FromString(answer)
    common = r.request_body.response if body else r.request_headers.response
    got = {o.header.key: o.header.raw_value for o in common.header_mutation.set_headers}
    return got["x-gateway-destination-endpoint"].decode()


def _log(pin: str, served_by: str | None = None, attempts: int = 1, flag: str | None = None, status: int = 200,
         duration_ms: float = 50.0, ttft_ms: float | None = None) -> bytes:
    msg = als_pb2.StreamAccessLogsMessage()
    entry = msg.http_logs.log_entry.add()
    entry.request.request_headers["x-inferlb-cluster"] = "c"
    entry.request.request_headers["x-gateway-destination-endpoint"] = pin
    props = entry.common_properties
    host, port = (served_by or pin).rsplit(":", 1)
    props.upstream_remote_address.socket_address.address = host
    props.upstream_remote_address.socket_address.port_value = int(port)
    props.upstream_request_attempt_count = attempts
    props.time_to_last_downstream_tx_byte.FromNanoseconds(int(duration_ms * 1e6))
    if ttft_ms is not None:
        props.time_to_first_upstream_rx_byte.FromNanoseconds(int(ttft_ms * 1e6))
    if flag:
        setattr(props.response_flags, flag, True)
    entry.response.response_code.value = status
    return msg.SerializeToString()


def test_without_the_memory_queue_a_request_nothing_can_hold_goes_to_the_most_free_endpoint():
    handler = PickerHandler(ViewHolder(view()))
    handler.control.set_samples(MemorySamples.of({FOUR[0]: (100.0, 0.0), FOUR[1]: (1500.0, 0.0), FOUR[2]: (900.0, 0.0),
                                                  FOUR[3]: (10.0, 0.0)}))
    assert _endpoint(handler.process(StreamState(), _headers_msg())[0]) == FOUR[1]



def _immediate(answer: bytes):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    r = pb.ProcessingResponse.FromString(answer).immediate_response
    return r.status.code, json.loads(r.body)["error"]["message"], {h.header.key for h in r.headers.set_headers}


@pytest.mark.parametrize("memory_queue", [False, True])
def test_a_request_larger_than_every_endpoints_whole_memory_gets_a_503_that_says_so(memory_queue):
    """Issue 15 item 4: forwarded, such a request could only fail on a backend (500 oom), and those
    failures took the endpoints out of the cluster. Default need 2048 MiB; largest endpoint 2000;
    no memory samples yet (free memory unknown)."""
    from ext_proc.admission import Admission
    admission = Admission(8, 0.1, 1) if memory_queue else None
    handler = PickerHandler(ViewHolder(view()), admission=admission, limit_concurrency=False,
                            memory_queue=memory_queue)
    handler.control.set_largest_memory({"c": 2000.0})
    status, message, extra = _immediate(handler.process(StreamState(), _headers_msg())[0])
    assert status == 503 and "retry-after" not in extra
    assert "no endpoint with 2048 MiB" in message and "the largest has 2000 MiB" in message and "'c'" in message
    assert not handler.control.inflight.clusters


def test_a_request_that_fits_the_largest_endpoint_or_an_unknown_cluster_is_not_refused_as_too_large():
    handler = PickerHandler(ViewHolder(view()))
    # no room now: best effort, not a refusal
    handler.control.set_samples(MemorySamples.of({e: (10.0, 0.0) for e in FOUR}))
    handler.control.set_largest_memory({"c": 4096.0})
    assert _endpoint(handler.process(StreamState(), _headers_msg())[0]) in FOUR
    handler.control.set_largest_memory({"other": 1.0})
    assert _endpoint(handler.process(StreamState(), _headers_msg())[0]) in FOUR

def test_at_low_load_the_bound_is_at_least_min_bound_so_a_next_turn_does_not_spill():
    p = pool(FOUR[:3])
    home, _ = choose(p, 99, None, {}, 0.0)
    # The previous turn's completion has not arrived yet: its endpoint holds 1 of 1 in flight.
    assert choose(p, 99, home, {home: 1.0}, 1.0)[1] == "spilled"  # 1 >= 1.25 x 2 / 3
    assert choose(p, 99, home, {home: 1.0}, 1.0, min_bound=2.0) == (home, "affinity")
    assert choose(p, 99, home, {home: 2.0}, 2.0, min_bound=2.0)[1] == "spilled"


def test_scheduler_settings_travel_over_xds_unchanged():
    """A standalone picker (``inferlb ext-proc --xds``) reads the same routing table and settings."""
    from google.protobuf import json_format, struct_pb2

    from ext_proc.settings import PickerSettings, from_wire, to_wire
    slack = build_profile([{"plugin": "bounded-load", "params": {"load_factor": 1.5, "min_bound": 3.0,
                                                                 "pinned_load_factor": 3.0}},
                           {"plugin": "affinity-slack", "params": {"slack": 0.75, "cost_aware": True}},
                           {"plugin": "least-loaded", "weight": 2}, {"plugin": "max-score"}], "slack")
    services = (ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, profile="slack", affinity="strict"),)
    routing = RoutingTable(services=services, memory_margin=0.3,
                           profiles={"default": build_profile([{"plugin": "ring-affinity"}]), "slack": slack},
                           default_request_mib=4096.0, kv_mib_per_token=0.25, default_max_tokens=64,
                           chars_per_token=3.5, request_memory_header="x-sim-memory-mib",
                           request_classes={"big": RequestClass(18432.0, 2000.0, 512.0)}, prefix_messages=3,
                           prefix_max_bytes=1000, prefix_cache_tokens=64_000, engine_block_size=16,
                           body_mode="streamed")
    settings_ = PickerSettings(inflight_expiry_s=130.0, session_ttl_s=1800.0, max_sessions=1000, admission=True,
                               max_queue=256, queue_timeout_s=0.1, retry_after_s=1, memory_queue=True,
                               pin_move_after=5, failure_hold_s=2.0, cost_forget=0.99, cost_min_samples=7,
                               shared_view=False, shared_view_interval_s=0.1, shared_view_expiry_s=1.0,
                               prefix_source="kv_events", kv_events_endpoint="tcp://{host}:{port+1000}",
                               kv_events_topic="kv", pending_s=2.5)
    struct = json_format.ParseDict(to_wire(routing, settings_), struct_pb2.Struct())  # as in cluster metadata
    back_routing, back_settings = from_wire(json_format.MessageToDict(struct))
    assert back_settings == settings_
    assert back_routing == routing  # every field: the wire form is derived from them
    assert dict(back_routing.request_classes) == dict(routing.request_classes)


def test_an_established_session_keeps_its_pin_up_to_the_looser_pinned_bound():
    p = pool()
    home, _ = choose(p, 5, None, {}, 0.0)
    loads = {home: 4.0}  # 4 of 8 in flight: over 1.25 x 9 / 4 = 2.8, under 2 x 9 / 4 = 4.5
    total = 8.0
    assert choose(p, 5, home, loads, total)[1] == "spilled"
    assert choose(p, 5, home, loads, total, pinned_load_factor=2.0) == (home, "affinity")
    assert choose(p, 5, None, loads, total, pinned_load_factor=2.0)[1] == "spilled"  # a new session is placed


# --- affinity slack ------------------------------------------------------------------------------


def test_with_a_slack_a_pin_is_kept_only_within_slack_requests_of_the_least_loaded():
    p = pool()
    home, _ = choose(p, 5, None, {}, 0.0)
    loads = {home: 2.0}  # the others idle; under the bounded-load bound max(1.25 x 3 / 4, 4) = 4
    assert choose(p, 5, home, loads, 2.0, min_bound=4.0) == (home, "affinity")
    chosen, reason = choose(p, 5, home, loads, 2.0, min_bound=4.0, affinity_slack=1.0)  # 3 > 1 + 1
    assert reason == "spilled" and chosen != home and loads.get(chosen, 0.0) == 0.0
    assert choose(p, 5, home, loads, 2.0, min_bound=4.0, affinity_slack=2.0) == (home, "affinity")  # 3 <= 1 + 2


def test_the_slack_is_per_share_so_a_bigger_endpoint_holds_more():
    eps = FOUR[:3]
    p = pool(eps, {eps[0]: 2, eps[1]: 1, eps[2]: 1})  # shares 0.5, 0.25, 0.25
    loads = {eps[0]: 2.0}
    # (2 + 1) / 0.5 = 6 against the least (0 + 1) / 0.25 = 4: within 1 x 3 = 3 of it, not within 0.5 x 3
    assert choose(p, 1, eps[0], loads, 2.0, min_bound=9.0, affinity_slack=1.0) == (eps[0], "affinity")
    assert choose(p, 1, eps[0], loads, 2.0, min_bound=9.0, affinity_slack=0.5)[1] == "spilled"


def test_a_spill_under_the_slack_goes_to_the_first_endpoint_clockwise_within_it():
    p = pool()
    owners, i = p.ring.owners, p.ring.start_index(7)
    walk: list[str] = []
    for k in range(len(owners)):
        e = owners[(i + k) % len(owners)]
        if e not in walk:
            walk.append(e)
    loads = {walk[0]: 3.0, walk[1]: 2.0, walk[2]: 1.0, walk[3]: 0.0}  # walk[2] is within 1 of the least
    assert choose(p, 7, None, loads, 6.0, min_bound=10.0, affinity_slack=1.0) == (walk[2], "spilled")
    assert choose(p, 7, None, loads, 6.0, min_bound=10.0) == (walk[0], "affinity")  # no slack: the bound alone


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=2, max_size=8), st.lists(st.floats(0.0, 20.0), min_size=8, max_size=8),
       st.floats(0.0, 3.0), st.floats(0.05, 4.0), st.integers(0, 2**64 - 1), st.booleans())
def test_the_chosen_endpoint_is_always_within_the_slack_of_the_least_loaded(weights, loads, slack, work, key, pin):
    endpoints = [f"10.0.0.{i}:8000" for i in range(len(weights))]
    p = pool(endpoints, dict(zip(endpoints, weights, strict=True)))
    load = dict(zip(endpoints, loads[:len(endpoints)], strict=True))
    pinned = endpoints[key % len(endpoints)] if pin else None
    chosen, _ = choose(p, key, pinned, load, sum(load.values()), work, pinned_load_factor=2.0, affinity_slack=slack)
    least = min((load[e] + work) / p.shares[e] for e in endpoints)
    assert (load[chosen] + work) / p.shares[chosen] <= least + slack * len(endpoints) + 1e-6


def test_pools_above_the_scan_size_keep_the_bounded_loads_alone():
    from ext_proc.scheduling import SCAN_MAX
    eps = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(SCAN_MAX + 1)]
    p = pool(eps)
    home, _ = choose(p, 11, None, {}, 0.0)
    loads = {home: 1.0}
    assert choose(p, 11, home, loads, 1.0, min_bound=2.0, affinity_slack=0.0) == (home, "affinity")
