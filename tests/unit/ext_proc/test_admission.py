"""Admission control: the pure rule, the per-cluster queues, and the handler holding or refusing requests."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.admission import Admission, admit
from ext_proc.handler import PickerHandler, StreamState
from ext_proc.inflight import MemorySamples
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder, cluster_details
from tests.unit.ext_proc.test_inflight import log_message
from tests.unit.ext_proc.test_picker import HEALTHY, cla


@pytest.mark.parametrize(("in_flight", "capacity", "queued", "max_queue", "want"), [
    (0, 0, 0, 0, "admit"),  # capacity unknown: never limited
    (99, 0, 5, 0, "admit"),
    (3, 4, 0, 10, "admit"),
    (4, 4, 0, 10, "queue"),
    (3, 4, 1, 10, "queue"),  # room, but others wait first (FIFO)
    (4, 4, 10, 10, "reject"),
    (4, 4, 0, 0, "reject"),  # max_queue 0: reject mode
])
def test_admit(in_flight, capacity, queued, max_queue, want):
    assert admit(in_flight, capacity, queued, max_queue) == want


ROUTING = RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity="soft"),))


def limited(limits: list[int | None]):
    assignment = cla("llm-v1", [(f"10.0.0.{i}", HEALTHY) for i in range(len(limits))])
    for lb, limit in zip(assignment.endpoints[0].lb_endpoints, limits, strict=True):
        if limit is not None:
            lb.metadata.filter_metadata["inferlb"].update({"max_concurrency": limit})
    return assignment


def test_capacity_is_the_sum_of_endpoint_limits_or_unknown():
    assert cluster_details(limited([2, 3])).capacity == 5
    assert cluster_details(limited([2, None])).capacity == 0
    view = EndpointView.build({"llm-v1": limited([1, 1])}, ROUTING)
    assert view.clusters["llm-v1"].capacity == 2


def headers_msg(session: str) -> bytes:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                     for k, v in {":authority": "x", "x-session-id": session}.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True)).SerializeToString()


def make_handler(max_queue=2, timeout_s=0.2) -> PickerHandler:
    h = PickerHandler(ViewHolder(EndpointView.build({"llm-v1": limited([1, 1])}, ROUTING)),
                      admission=Admission(max_queue, timeout_s, retry_after_s=3))
    h.control.inflight.streams = 1  # an access-log stream is open
    return h


def kind(answer: bytes) -> tuple[str, int | None]:
    r = pb.ProcessingResponse.FromString(answer)
    return r.WhichOneof("response"), r.immediate_response.status.code if r.HasField("immediate_response") else None


async def test_a_full_cluster_queues_then_admits_on_a_completion():
    h = make_handler()
    for i in range(2):
        answer, end = h.process(StreamState(), headers_msg(f"s{i}"))
        assert kind(answer) == ("request_headers", None) and end
    waiting, end = h.process(StreamState(), headers_msg("s2"))
    assert isinstance(waiting, asyncio.Future) and end and not waiting.done()
    h.access_log(log_message(("llm-v1", None)))  # one request finished
    assert waiting.done() and kind(waiting.result()) == ("request_headers", None)
    assert h.control.inflight.clusters == {"llm-v1": 2}


async def test_a_request_queued_for_a_slot_goes_only_once_an_endpoint_also_has_memory_for_it():
    """A slot freed by a completion is no room when no endpoint has the memory: resumed on the slot
    alone, the request was forwarded unpinned (Envoy's blind choice: an OOM in the uneven bench)."""
    h = PickerHandler(ViewHolder(EndpointView.build({"llm-v1": limited([1, 1])}, ROUTING)),
                      admission=Admission(4, 1.0, retry_after_s=3), memory_queue=True)
    h.control.inflight.streams = 1
    endpoints = ["10.0.0.0:8000", "10.0.0.1:8000"]
    h.control.set_samples(MemorySamples.of({e: (20_000.0, h.control.inflight.now()) for e in endpoints}))
    for i in range(2):
        answer, _ = h.process(StreamState(), headers_msg(f"s{i}"))
        assert kind(answer) == ("request_headers", None)
    waiting, _ = h.process(StreamState(), headers_msg("s2"))
    assert isinstance(waiting, asyncio.Future) and not waiting.done()  # the cluster is full
    # both running: no room left
    h.control.set_samples(MemorySamples.of({e: (50.0, h.control.inflight.now() + 1.0) for e in endpoints}))
    h.access_log(log_message(("llm-v1", None)))  # a slot frees, the memory does not
    assert not waiting.done()
    h.control.set_samples(MemorySamples.of({e: (20_000.0, h.control.inflight.now() + 2.0) for e in endpoints}))
    assert waiting.done()
    r = pb.ProcessingResponse.FromString(waiting.result())
    pins = {o.header.key for o in r.request_headers.response.header_mutation.set_headers}
    assert "x-gateway-destination-endpoint" in pins


async def test_a_waiter_that_fits_goes_by_an_older_one_that_does_not_but_only_with_a_slot():
    a = Admission(8, 1.0, 1)
    fits = {"big": False, "small": True}
    waiting = {n: a.enqueue("c", lambda n=n: n.encode(), lambda: b"429", lambda n=n: fits[n]) for n in fits}
    assert a.release(lambda cluster: False) == 0  # no slot: nobody goes, however it fits
    assert a.release(lambda cluster: True) == 1
    assert waiting["small"].result() == b"small" and not waiting["big"].done()
    fits["big"] = True
    assert a.release(lambda cluster: True) == 1 and waiting["big"].result() == b"big"
    assert a.queued("c") == 0


async def test_the_memory_queue_lists_its_waiters_oldest_first_with_their_need_and_wait():
    """What a picker's load reports carry of its queue (the ledger serves the oldest waiter of all pickers
    first): the requests waiting for memory, oldest first across clusters by when they began to wait (a
    request sent back keeps its place), not those waiting for a slot nor those gone."""
    a = Admission(8, 1.0, 1)
    now = asyncio.get_running_loop().time()
    a.enqueue("c", lambda: b"", lambda: b"429", lambda: False, mib=8192.0)
    a.enqueue("c", lambda: b"", lambda: b"429", lambda: False)  # waits for a slot only
    gone = a.enqueue("d", lambda: b"", lambda: b"429", lambda: False, mib=18432.0)
    a.enqueue("d", lambda: b"", lambda: b"429", lambda: False, mib=18432.0, since=now - 0.05)
    listed = a.memory_waiters()
    assert [(c, mib) for _, c, mib, _ in listed] == [("d", 18432.0), ("c", 8192.0), ("d", 18432.0)]
    assert listed[0][3] >= 0.05 and listed[1][3] < 0.05 and len({i for i, *_ in listed}) == 3
    gone.cancel()
    assert len(a.memory_waiters()) == 2 and Admission(8, 1.0, 1).memory_waiters() == []


async def test_queue_bound_and_timeout_answer_429_with_retry_after():
    h = make_handler(max_queue=1, timeout_s=0.05)
    for i in range(2):
        h.process(StreamState(), headers_msg(f"s{i}"))
    queued, _ = h.process(StreamState(), headers_msg("q"))
    refused, _ = h.process(StreamState(), headers_msg("r"))  # the queue (1) is full: at once
    r = pb.ProcessingResponse.FromString(refused)
    assert r.immediate_response.status.code == 429
    extra = {o.header.key: o.header.raw_value for o in r.immediate_response.headers.set_headers}
    assert extra["retry-after"] == b"3"
    assert "llm-v1" in json.loads(r.immediate_response.body)["error"]["message"]
    assert kind(await asyncio.wait_for(queued, 1)) == ("immediate_response", 429)  # timed out
    assert h.control.inflight.clusters == {"llm-v1": 2}, "refused requests are not in flight"


async def test_a_cancelled_waiter_gives_its_slot_to_the_next():
    h = make_handler()
    for i in range(2):
        h.process(StreamState(), headers_msg(f"s{i}"))
    first, _ = h.process(StreamState(), headers_msg("a"))
    second, _ = h.process(StreamState(), headers_msg("b"))
    first.cancel()  # its stream went away
    h.access_log(log_message(("llm-v1", None)))
    assert second.done() and kind(second.result()) == ("request_headers", None)


async def test_without_an_access_log_stream_nothing_is_held():
    h = make_handler()
    h.control.inflight.streams = 0
    for i in range(5):
        answer, _ = h.process(StreamState(), headers_msg(f"s{i}"))
        assert kind(answer) == ("request_headers", None)


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="admission"):
        Admission(8, 0, 1)


def test_locality_metadata_is_the_default_of_its_endpoints():
    assignment = limited([None, 3, 0])
    locality = assignment.endpoints[0]
    locality.metadata.filter_metadata["inferlb"].update({"max_concurrency": 5, "gpu_class": "a100"})
    locality.lb_endpoints[1].metadata.filter_metadata["inferlb"].update({"gpu_class": "a10"})
    details = cluster_details(assignment)
    assert details.capacity == 0  # the third one's own 0 overrides the locality's 5: not limited
    assert details.classes == {"10.0.0.0:8000": "a100", "10.0.0.1:8000": "a10", "10.0.0.2:8000": "a100"}
    del locality.lb_endpoints[2]
    assert cluster_details(assignment).capacity == 5 + 3


def test_one_locality_with_locality_wide_metadata_only():
    # the usual shape (one locality, no endpoint values of its own): an address listed twice keeps its
    # first listing's weight, unpinnable endpoints are left out, as with two localities
    hosts = [("10.0.0.2", HEALTHY), ("10.0.0.1", HEALTHY), ("10.0.0.2", HEALTHY),
             ("10.0.0.3", health_check_pb2.UNHEALTHY)]
    one = cla("llm-v1", hosts)
    locality = one.endpoints[0]
    locality.metadata.filter_metadata["inferlb"].update({"max_concurrency": 4, "gpu_class": "a100"})
    for lb, weight in zip(locality.lb_endpoints, [7, 0, 9, 5], strict=True):
        if weight:
            lb.load_balancing_weight.value = weight
    details = cluster_details(one)
    assert details == (("10.0.0.1:8000", "10.0.0.2:8000"), 8, {"10.0.0.1:8000": 1, "10.0.0.2:8000": 7},
                       {"10.0.0.1:8000": "a100", "10.0.0.2:8000": "a100"})
    two = type(one)()
    two.CopyFrom(one)
    two.endpoints.add(priority=0).CopyFrom(locality)  # a second locality: the general path
    assert cluster_details(two) == details
