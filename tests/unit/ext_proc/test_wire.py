"""The compiled request-headers decoder (``ext_proc._wire``) against its reference (protobuf's parse
and ``headers_of``, :func:`ext_proc.wire.request_headers_py`): differential tests on generated,
real and corrupted messages."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ext_proc import _wire, wire  # _wire: built by pip install / scripts/setup.sh
from ext_proc.wire import request_body_py
from ext_proc.wire import request_headers_py as reference
from tests.support.corruption import corrupt

compiled = _wire.request_headers
compiled_body = _wire.request_body

# One request-headers message as Envoy 1.40 sent it in `inferlb bench picker` (captured from the
# null server): nine headers in raw_value, end_of_stream, an empty metadata_context and protocol_config.
ENVOY_MESSAGE = bytes.fromhex(
    "128d020a88020a1d0a0a3a617574686f726974791a0f3132372e302e302e313a33323737330a1d0a053a706174681a142f76"
    "312f636861742f636f6d706c6574696f6e730a0e0a073a6d6574686f641a034745540a0f0a073a736368656d651a04687474"
    "700a130a0d6d6f64656c2d76657273696f6e1a0276310a200a0c636f6e74656e742d747970651a106170706c69636174696f"
    "6e2f6a736f6e0a1f0a0c782d73657373696f6e2d69641a0f62656e63682d73657373696f6e2d320a190a11782d666f727761"
    "726465642d70726f746f1a04687474700a340a0c782d726571756573742d69641a2465323534353631392d666564332d3436"
    "35322d626239342d376436636431613134323231180142005a00")

ascii_names = st.sampled_from([":authority", ":path", ":method", "x-session-id", "X-Session-Id", "model-version",
                               "Cookie", "content-type", "x-request-id", "", "a", "1", "X-A"])
any_names = st.one_of(ascii_names, st.text(max_size=6))  # non-ASCII names: left to protobuf
values = st.binary(max_size=8)


def _message(items, end_of_stream: bool, extras: dict) -> bytes:
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, value=v, raw_value=r) for k, v, r in items]), end_of_stream=end_of_stream)
    return pb.ProcessingRequest(request_headers=headers, **extras).SerializeToString()


envoy_extras = st.fixed_dictionaries({}, optional={
    "metadata_context": st.just(base_pb2.Metadata()),
    "observability_mode": st.booleans(),
    "protocol_config": st.builds(pb.ProtocolConfiguration, request_body_mode=st.integers(0, 5),
                                 response_body_mode=st.integers(0, 5),
                                 send_body_without_waiting_for_header_response=st.booleans()),
})


def test_envoys_message_is_decoded_by_the_compiled_decoder():
    assert compiled(ENVOY_MESSAGE) == reference(ENVOY_MESSAGE)
    headers, end_of_stream = compiled(ENVOY_MESSAGE)
    assert end_of_stream is True
    assert headers["x-session-id"] == b"bench-session-2" and headers[":path"] == b"/v1/chat/completions"


def test_the_picker_uses_the_compiled_decoder_here():
    """scripts/setup.sh (pip install) builds it on this kind of machine; wire falls back only without it."""
    assert wire.request_headers is compiled
    assert wire.DECODER.startswith("compiled")


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(ascii_names, st.text(max_size=4), values), max_size=12), st.booleans(), envoy_extras)
def test_envoys_shape_decodes_as_the_reference(items, end_of_stream, extras):
    """ASCII names (any case), value and/or raw_value, the extra fields Envoy sends: the compiled
    decoder takes it and gives what protobuf + headers_of give."""
    data = _message(items, end_of_stream, extras)
    got = compiled(data)
    assert got is not None
    assert got == reference(data)
    assert list(got[0]) == list(dict.fromkeys(k.lower() for k, _, _ in items))  # first occurrence, in order


other_phases = st.sampled_from(["response_headers", "request_body", "request_trailers"])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(any_names, st.text(max_size=4), values), max_size=8), st.booleans(),
       st.sampled_from(["none", "metadata", "attributes", "phase", "twice"]))
def test_any_message_is_declined_or_decoded_as_the_reference(items, end_of_stream, extra):
    """Non-ASCII names, non-empty metadata, attributes, another phase, request_headers twice
    (protobuf merges): declined (None) or decoded exactly as the reference does."""
    data = _message(items, end_of_stream, {})
    if extra == "metadata":
        request = pb.ProcessingRequest()
        request.metadata_context.filter_metadata["f"].update({"k": "v"})
        data += request.SerializeToString()
    elif extra == "attributes":
        request = pb.ProcessingRequest()
        request.attributes["a"].update({"k": 1})
        data += request.SerializeToString()
    elif extra == "phase":
        data += pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x")).SerializeToString()
    elif extra == "twice":
        data += data
    got = compiled(data)
    assert got is None or got == reference(data)
    if extra == "phase":
        assert got is None and reference(data) is None  # the last phase field wins: not headers


@settings(max_examples=2000, deadline=None)
@given(st.data())
@example(None)
def test_corrupted_bytes_are_declined_or_decoded_as_the_reference(data):
    """Byte edits, truncations and insertions into real and generated messages: the compiled
    decoder never accepts what protobuf rejects, and never decodes differently."""
    if data is None:
        candidates = [ENVOY_MESSAGE[:n] for n in range(len(ENVOY_MESSAGE))]
    else:
        base = data.draw(st.one_of(st.just(ENVOY_MESSAGE), st.builds(
            _message, st.lists(st.tuples(any_names, st.text(max_size=3), values), max_size=4), st.booleans(),
            envoy_extras)))
        candidates = [corrupt(data, base)]
    for candidate in candidates:
        got = compiled(candidate)
        assert got is None or got == reference(candidate), candidate.hex()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_are_declined_or_decoded_as_the_reference(data):
    got = compiled(data)
    assert got is None or got == reference(data)


def test_without_the_compiled_decoder_the_picker_decides_the_same(monkeypatch):
    """The fallback (no ``ext_proc._wire``): the handler parses with protobuf and answers byte for byte
    as with the compiled decoder (the same view, the same requests)."""
    from ext_proc import handler as handler_module
    from ext_proc.handler import PickerHandler
    from ext_proc.transport.base import StreamState
    from ext_proc.view import ViewHolder
    from tests.unit.ext_proc.test_scheduler import _headers_msg, view

    messages = [_headers_msg(x_session_id=b"s%d" % i) for i in range(20)] + [_headers_msg()]
    with_c = PickerHandler(ViewHolder(view()))
    compiled_answers = [with_c.process(StreamState(), m)[0] for m in messages]
    monkeypatch.setattr(handler_module, "request_headers", None)
    fallback = PickerHandler(ViewHolder(view()))
    assert [fallback.process(StreamState(), m)[0] for m in messages] == compiled_answers


# --- the request-body decoder ---------------------------------------------------------------------


def _body_message(body: bytes, end_of_stream: bool, extras: dict) -> bytes:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream),
                                **extras).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40_000), st.booleans(), envoy_extras)
def test_envoys_body_message_decodes_as_the_reference(body, end_of_stream, extras):
    """A request_body message of Envoy's shape (the body, end_of_stream, the extra fields Envoy sends):
    the compiled decoder takes it and gives what protobuf gives."""
    data = _body_message(body, end_of_stream, extras)
    assert compiled_body(data) == request_body_py(data) == (body, end_of_stream)
    assert compiled(data) is None  # the headers decoder leaves it alone


@settings(max_examples=2000, deadline=None)
@given(st.data())
def test_corrupted_body_messages_are_declined_or_decoded_as_the_reference(data):
    """Byte edits, truncations and insertions, another phase after the body, a body twice, the other
    HttpBody fields: the compiled decoder never accepts what protobuf rejects, and never decodes
    differently."""
    base = data.draw(st.one_of(
        st.builds(_body_message, st.binary(max_size=300), st.booleans(), envoy_extras),
        st.just(_body_message(b"ab", True, {}) + ENVOY_MESSAGE),
        st.just(_body_message(b"ab", True, {}) * 2),
        st.just(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x", end_of_stream_without_message=True,
                                                              grpc_message_compressed=True)).SerializeToString())))
    candidate = corrupt(data, base) if data.draw(st.booleans()) else base
    got = compiled_body(candidate)
    assert got is None or got == request_body_py(candidate), candidate.hex()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_are_declined_or_decoded_as_the_reference_body(data):
    got = compiled_body(data)
    assert got is None or got == request_body_py(data)


def test_without_the_compiled_decoders_a_read_body_is_decided_the_same(monkeypatch):
    """Held requests and their chat bodies (with and without a session): the handler answers byte for
    byte the same with protobuf's parse as with the compiled decoders."""
    import json

    from ext_proc import handler as handler_module
    from ext_proc.handler import PickerHandler
    from ext_proc.transport.base import StreamState
    from ext_proc.view import ViewHolder
    from tests.unit.ext_proc.test_scheduler import _body_msg, _headers_msg, view

    def answers(handler: PickerHandler) -> list[bytes]:
        out = []
        for i in range(20):
            stream = StreamState()
            session = {"x_session_id": b"s%d" % (i % 3)} if i % 2 else {}
            held, _ = handler.process(stream, _headers_msg(end=False, content_type=b"application/json", **session))
            body = json.dumps({"messages": [{"role": "system", "content": "p" * (600 * (i % 4))},
                                            {"role": "user", "content": f"q{i}"}], "max_tokens": 10 + i}).encode()
            out += [held, handler.process(stream, _body_msg(body))[0]]
        return out

    compiled_answers = answers(PickerHandler(ViewHolder(view())))
    monkeypatch.setattr(handler_module, "request_headers", None)
    monkeypatch.setattr(handler_module, "request_body", None)
    assert answers(PickerHandler(ViewHolder(view()))) == compiled_answers


def test_the_picker_uses_the_compiled_body_and_prompt_readers_here():
    """scripts/setup.sh (pip install) builds them; a build older than them leaves protobuf and the
    Python prompt reading in use (the same answers, slower): this test says so."""
    from ext_proc import prefix_index

    assert wire.request_body is compiled_body
    assert prefix_index.prompt_keys is prefix_index._compiled_prompt_keys
