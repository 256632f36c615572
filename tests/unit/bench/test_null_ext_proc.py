"""The bench's null ext_proc server: a no-change answer of the right phase, valid HTTP/2 and gRPC
(checked by the `h2` library as the client), and the stream ended like the picker ends it."""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.null_ext_proc import NullService, routed_answer
from ext_proc.responses import EMPTY_ANSWERS
from ext_proc.transport.base import StreamState
from tests.unit.ext_proc.test_ext_proc_server import headers_request
from tests.unit.ext_proc.test_fast_transport import Peer


def _answer(service: NullService, request: pb.ProcessingRequest) -> tuple[pb.ProcessingResponse, bool]:
    data, end = service.process(StreamState(), request.SerializeToString())
    return pb.ProcessingResponse.FromString(data), end


def test_headers_get_a_no_change_answer_that_ends_the_stream():
    answer, end = _answer(NullService(), headers_request(model_version="v1", x_session_id="s"))
    assert answer.WhichOneof("response") == "request_headers"
    assert not answer.request_headers.HasField("response") and not answer.HasField("mode_override")
    assert end


def test_every_phase_is_answered_in_its_own_phase():
    for phase in EMPTY_ANSWERS:
        field = pb.ProcessingRequest.DESCRIPTOR.fields_by_name[phase].message_type._concrete_class()
        answer, _ = _answer(NullService(), pb.ProcessingRequest(**{phase: field}))
        assert answer.WhichOneof("response") == phase


def test_a_message_not_starting_with_its_phase_is_parsed():
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True),
                                   observability_mode=True)
    data = request.SerializeToString()
    assert data[-2:] == b"\x50\x01"  # observability_mode (field 10, varint 1) last
    reordered = data[-2:] + data[:-2]  # ... and now first: valid protobuf, any field order
    assert reordered[0] != 0x22 and pb.ProcessingRequest.FromString(reordered) == request
    answer, end = NullService(hold_body=True).process(StreamState(), reordered)
    assert pb.ProcessingResponse.FromString(answer).WhichOneof("response") == "request_body" and end


def test_hold_body_asks_for_the_buffered_body_then_ends_on_it():
    service = NullService(hold_body=True)
    answer, end = _answer(service, headers_request(model_version="v1"))
    assert answer.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED and not end
    answer, end = _answer(service, pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    assert answer.WhichOneof("response") == "request_body" and end


def test_over_http2_the_answer_and_an_ok_status_arrive():
    peer = Peer(NullService())
    sid = peer.call([headers_request(model_version="v1").SerializeToString()], end=False)
    peer.pump()
    messages, trailers = peer.result(sid)
    assert messages == [EMPTY_ANSWERS["request_headers"]]
    assert trailers[b"grpc-status"] == b"0" and peer.ended(sid)


def test_a_routed_answer_sets_the_header_and_clears_the_route_cache():
    answer, end = _answer(NullService(headers_answer=routed_answer("x-inferlb-cluster", "bench-v1")),
                          headers_request(model_version="v1"))
    common = answer.request_headers.response
    assert common.clear_route_cache and end
    assert [(o.header.key, o.header.raw_value) for o in common.header_mutation.set_headers] == \
        [("x-inferlb-cluster", b"bench-v1")]
    answer, _ = _answer(NullService(hold_body=True, headers_answer=routed_answer("x-c", "v")),
                        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    assert answer.request_body.response.clear_route_cache
