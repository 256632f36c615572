"""The Gateway API Inference Extension's endpoint-picker protocol in the picker (``picker.protocol:
gateway-api``), message by message through :meth:`PickerHandler.process` (no transport): the
destination in the header and the ``envoy.lb`` metadata, the subset hint, the 503s, and the body
modes the protocol's gateways configure (FULL_DUPLEX_STREAMED: the headers answer after the body,
the body sent back). Real Envoy configured as those gateways configure it:
tests/integration/test_gateway_api_envoy.py.
"""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from ext_proc.gateway import CHUNK_BYTES, subset_of
from ext_proc.handler import PickerHandler
from ext_proc.sampler import DecisionSampler
from ext_proc.transport.base import StreamState
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder
from tests.unit.ext_proc.test_picker import HEALTHY, cla

MODE = processing_mode_pb2.ProcessingMode
CHAT = ServiceRoute("chat", ("*",), "v1", {"v1": "chat-v1"}, models=frozenset({b"sim-7b"}), affinity="soft")
ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 4)]
SAMPLERS: dict[PickerHandler, DecisionSampler] = {}


def handler(body_max_bytes: int = 4096, ready: bool = True) -> PickerHandler:
    routing = RoutingTable(services=(CHAT,), body_max_bytes=body_max_bytes, protocol="gateway-api")
    holder = ViewHolder(EndpointView.empty(routing))
    if ready:
        holder.update({"chat-v1": cla("chat-v1", [(e.split(":")[0], HEALTHY) for e in ENDPOINTS])}, routing)
    sampler = DecisionSampler(every=1)
    h = PickerHandler(holder, sampler=sampler)
    SAMPLERS[h] = sampler
    return h


def headers_msg(end: bool = False, mode: int = MODE.FULL_DUPLEX_STREAMED, subset: object = None,
                request_id: str = "r1", **headers: str) -> bytes:
    request = pb.ProcessingRequest()
    fields = {":authority": "x", ":method": "POST", ":path": "/v1/chat/completions",
              "content-type": "application/json", "x-request-id": request_id,
              **{k.replace("_", "-"): v for k, v in headers.items()}}
    for k, v in fields.items():
        request.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    request.request_headers.end_of_stream = end
    request.protocol_config.request_body_mode = mode
    request.protocol_config.response_body_mode = mode
    if subset is not None:
        value = struct_pb2.Value()
        if isinstance(subset, str):
            value.string_value = subset
        else:
            value.list_value.values.extend(struct_pb2.Value(string_value=e) for e in subset)
        hint = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].CopyFrom(value)
    return request.SerializeToString()


def body_msg(data: bytes, end: bool, phase: str = "request_body") -> bytes:
    request = pb.ProcessingRequest()
    getattr(request, phase).body = data
    getattr(request, phase).end_of_stream = end
    return request.SerializeToString()


def chat(prompt: str = "You are terse. " * 20, user: str = "hello") -> bytes:
    return json.dumps({"model": "sim-7b", "max_tokens": 8, "messages": [
        {"role": "system", "content": prompt}, {"role": "user", "content": user}]}).encode()


def parse(answers) -> list[pb.ProcessingResponse]:
    return [pb.ProcessingResponse.FromString(a) for a in (answers if isinstance(answers, list) else [answers])]


def destination(answer: pb.ProcessingResponse) -> str:
    """The endpoint of a routed answer, checked to be the same in the header and the metadata."""
    which = answer.WhichOneof("response")
    common = getattr(answer, which).response
    [header] = [h for h in common.header_mutation.set_headers if h.header.key == "x-gateway-destination-endpoint"]
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert header.header.raw_value.decode() == meta.string_value
    assert header.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    assert "x-inferlb-cluster" not in {h.header.key for h in common.header_mutation.set_headers}
    return meta.string_value


def echoed(answers: list[pb.ProcessingResponse], phase: str) -> tuple[bytes, bool]:
    parts = [getattr(a, phase).response.body_mutation.streamed_response for a in answers]
    assert all(len(p.body) <= CHUNK_BYTES for p in parts)
    assert not any(p.end_of_stream for p in parts[:-1])
    return b"".join(p.body for p in parts), parts[-1].end_of_stream


def test_full_duplex_holds_the_headers_answer_until_the_body_ends_then_sends_it_and_the_body_back():
    h, stream = handler(), StreamState()
    body = chat()
    assert h.process(stream, headers_msg()) == (None, False)
    assert h.process(stream, body_msg(body[:100], False)) == (None, False)
    answers, end = h.process(stream, body_msg(body[100:], True))
    assert not end   # the response comes through the stream too
    first, *rest = parse(answers)
    assert first.WhichOneof("response") == "request_headers" and destination(first) in ENDPOINTS
    assert echoed(rest, "request_body") == (body, True)
    assert h.control.inflight.clusters == {"chat-v1": 1}
    # The response: headers unchanged, each body chunk sent back as it comes, the end counted.
    [answer] = parse(h.process(stream, pb.ProcessingRequest(
        response_headers=pb.HttpHeaders()).SerializeToString())[0])
    assert answer.WhichOneof("response") == "response_headers"
    for part, last in ((b"data: {}\n\n", False), (b"data: [DONE]\n\n", True)):
        answers, end = h.process(stream, body_msg(part, last, "response_body"))
        assert echoed(parse(answers), "response_body") == (part, last) and not end
    assert not h.control.inflight.clusters.get("chat-v1") and sum(h.control.inflight.work.values()) == 0


def test_the_same_prompt_prefix_goes_to_the_same_endpoint_and_a_large_body_comes_back_in_chunks():
    h = handler(body_max_bytes=1 << 20)
    seen = set()
    for i in range(5):
        stream = StreamState()
        body = chat(prompt="A long shared system prompt. " * 6000, user=f"question {i}")
        assert len(body) > 2 * CHUNK_BYTES
        h.process(stream, headers_msg(request_id=f"r{i}"))
        first, *rest = parse(h.process(stream, body_msg(body, True))[0])
        seen.add(destination(first))
        assert len(rest) == -(-len(body) // CHUNK_BYTES) and echoed(rest, "request_body") == (body, True)
        h.process(stream, body_msg(b"{}", True, "response_body"))
    assert len(seen) == 1
    assert [d.key for d in SAMPLERS[h].recent(5)] == ["prefix"] * 5


@pytest.mark.parametrize("subset", [["10.0.0.2:8000"], "10.0.0.2:8000, 10.9.9.9:1"])
def test_the_subset_hint_is_obeyed_as_a_list_or_a_comma_string(subset):
    h = handler()
    for i in range(20):
        stream = StreamState()
        [answer] = parse(h.process(stream, headers_msg(end=True, subset=subset, request_id=f"r{i}"))[0])
        assert destination(answer) == "10.0.0.2:8000"


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"], "  "])
def test_a_subset_hint_with_nothing_eligible_is_a_503(subset):
    h = handler()
    answer, end = h.process(StreamState(), headers_msg(end=True, subset=subset))
    [response] = parse(answer)
    assert end and response.immediate_response.status.code == 503
    assert json.loads(response.immediate_response.body)["error"]["code"] == "subset_empty"
    assert sum(h.control.inflight.clusters.values()) == 0


def test_no_endpoint_yet_is_a_503_not_a_pass_through():
    answer, end = handler(ready=False).process(StreamState(), headers_msg(end=True))
    [response] = parse(answer)
    assert end and response.immediate_response.status.code == 503
    assert json.loads(response.immediate_response.body)["error"]["code"] == "not_ready"


def test_a_body_above_body_max_bytes_is_decided_on_its_first_bytes_and_the_rest_flows_back():
    h, stream = handler(body_max_bytes=1000), StreamState()
    body = chat(prompt="x" * 3000)
    assert h.process(stream, headers_msg()) == (None, False)
    first, *rest = parse(h.process(stream, body_msg(body[:1500], False))[0])
    assert destination(first) in ENDPOINTS and echoed(rest, "request_body") == (body[:1500], False)
    answers, _ = h.process(stream, body_msg(body[1500:], True))
    assert echoed(parse(answers), "request_body") == (body[1500:], True)


def test_a_body_ended_by_trailers_is_decided_at_the_trailers():
    h, stream = handler(), StreamState()
    body = chat()
    h.process(stream, headers_msg())
    assert h.process(stream, body_msg(body, False)) == (None, False)
    first, *middle, last = parse(h.process(stream, pb.ProcessingRequest(
        request_trailers=pb.HttpTrailers()).SerializeToString())[0])
    assert destination(first) in ENDPOINTS and echoed(middle, "request_body") == (body, False)
    assert last.WhichOneof("response") == "request_trailers"


def test_body_mode_none_decides_on_the_headers_and_buffered_on_the_body():
    h = handler()
    [answer] = parse(h.process(StreamState(), headers_msg(mode=MODE.NONE))[0])
    assert answer.WhichOneof("response") == "request_headers" and destination(answer) in ENDPOINTS
    stream = StreamState()
    [held] = parse(h.process(stream, headers_msg(mode=MODE.BUFFERED, request_id="r2"))[0])
    assert held.WhichOneof("response") == "request_headers"
    assert not held.request_headers.response.header_mutation.set_headers
    [routed] = parse(h.process(stream, body_msg(chat(), True))[0])
    assert routed.WhichOneof("response") == "request_body" and destination(routed) in ENDPOINTS


def test_subset_of_reads_nothing_when_the_gateway_sent_no_hint():
    assert subset_of(pb.ProcessingRequest.FromString(headers_msg())) is None
    assert subset_of(pb.ProcessingRequest.FromString(headers_msg(subset=["a:1", "b:2,c:3"]))) == {"a:1", "b:2", "c:3"}
