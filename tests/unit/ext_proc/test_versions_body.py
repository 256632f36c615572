"""Canary mixes and body routing in the pure picker and the handler (no transport)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.body import MAX_JSON_DEPTH, BodyFields, JsonTooDeep, read_json
from ext_proc.handler import PickerHandler, StreamState
from ext_proc.picker import pick
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute, ViewHolder
from tests.unit.ext_proc.test_picker import HEALTHY, cla

MIXED = ServiceRoute("llm", ("*",), "stable", {"v1": "llm-v1", "v2": "llm-v2"},
                     mixes={"stable": {"v1": 90, "v2": 10}, "half": {"v1": 50, "v2": 50}}, affinity="soft")
ROUTING = RoutingTable(services=(MIXED,), body_max_bytes=4096)
ASSIGN = {c: cla(c, [(f"10.0.{n}.{i}", HEALTHY) for i in range(3)]) for n, c in ((1, "llm-v1"), (2, "llm-v2"))}
VIEW = EndpointView.build(ASSIGN, ROUTING)


def route(**headers: bytes):
    return pick({":authority": b"x", **{k.replace("_", "-"): v for k, v in headers.items()}}, VIEW)


def test_a_mix_splits_sessions_by_share_and_a_session_never_flips():
    clusters = {}
    for i in range(4000):
        first = route(x_session_id=b"s%d" % i).cluster
        assert all(route(x_session_id=b"s%d" % i).cluster == first for _ in range(3))
        clusters[i] = first
    share = Counter(clusters.values())["llm-v2"] / 4000
    assert 0.08 <= share <= 0.12
    half = Counter(route(model_version=b"half", x_session_id=b"s%d" % i).cluster for i in range(4000))
    assert 0.45 <= half["llm-v2"] / 4000 <= 0.55


def test_raising_a_canary_share_only_moves_sessions_toward_it():
    more = ServiceRoute("llm", ("*",), "stable", {"v1": "llm-v1", "v2": "llm-v2"},
                        mixes={"stable": {"v1": 70, "v2": 30}}, affinity="soft")
    view = EndpointView.build(ASSIGN, RoutingTable(services=(more,)))
    for i in range(2000):
        before = route(x_session_id=b"s%d" % i).cluster
        after = pick({":authority": b"x", "x-session-id": b"s%d" % i}, view).cluster
        assert before == after or after == "llm-v2"


def test_requests_without_a_session_split_by_request_id():
    got = Counter(route(x_request_id=b"req-%d" % i).cluster for i in range(4000))
    assert 0.08 <= got["llm-v2"] / 4000 <= 0.12
    assert route(x_request_id=b"same").cluster == route(x_request_id=b"same").cluster


def test_unknown_names_list_versions_and_mixes():
    d = route(model_version=b"v9")
    assert d.status == 400
    assert "known versions: half, stable, v1, v2" in json.loads(d.body)["error"]["message"]


@pytest.mark.parametrize("shares", [{"v1": 90, "v2": 20}, {"v3": 100}, {"v1": -10, "v2": 110}, {}])
def test_bad_mixes_are_refused(shares):
    with pytest.raises(ValueError, match="mix"):
        ServiceRoute("llm", ("*",), "v1", {"v1": "a", "v2": "b"}, mixes={"m": shares}, affinity="soft")


def test_a_mix_may_not_shadow_a_version():
    with pytest.raises(ValueError, match="name of a version"):
        ServiceRoute("llm", ("*",), "v1", {"v1": "a", "v2": "b"}, mixes={"v2": {"v1": 100}}, affinity="soft")


def test_body_fields_route_and_pin_like_headers():
    by_body = pick({":authority": b"x"}, VIEW, body=BodyFields(b"v2", b"alice"))
    by_header = route(model_version=b"v2", x_session_id=b"alice")
    assert (by_body.cluster, by_body.endpoint) == (by_header.cluster, by_header.endpoint) == (
        "llm-v2", by_header.endpoint)
    header_wins = pick({":authority": b"x", "model-version": b"v1"}, VIEW, body=BodyFields(b"v2"))
    assert header_wins.cluster == "llm-v1"
    # A service that lists its model names: a body model that is not UTF-8 is a 400 naming the field.
    named = ServiceRoute("llm", ("*",), "stable", {"v1": "llm-v1", "v2": "llm-v2"}, mixes=MIXED.mixes,
                         models=frozenset({b"sim-7b"}), affinity="soft")
    bad = pick({":authority": b"x"}, EndpointView.build(ASSIGN, RoutingTable(services=(named,))),
               body=BodyFields(b"\xff"))
    assert bad.status == 400 and "body field 'model'" in json.loads(bad.body)["error"]["message"]


def message(phase: str, **fields) -> bytes:
    return pb.ProcessingRequest(**{phase: fields}).SerializeToString()


def headers_msg(end: bool, **headers: str) -> bytes:
    values = {":authority": "x", "content-type": "application/json", **{k.replace("_", "-"): v
                                                                        for k, v in headers.items()}}
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end)).SerializeToString()


def handler() -> PickerHandler:
    return PickerHandler(ViewHolder(VIEW))


def set_headers(common) -> dict[str, bytes]:
    return {o.header.key: o.header.raw_value for o in common.header_mutation.set_headers}


def test_handler_holds_headers_for_the_body_then_answers_the_body():
    h, stream = handler(), StreamState()
    answer, end = h.process(stream, headers_msg(False))
    first = pb.ProcessingResponse.FromString(answer)
    assert not end and first.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    assert not first.request_headers.response.header_mutation.set_headers
    body = json.dumps({"model": "v2", "user": "bob", "messages": []}).encode()
    answer, end = h.process(stream, message("request_body", body=body, end_of_stream=True))
    second = pb.ProcessingResponse.FromString(answer)
    assert end and second.WhichOneof("response") == "request_body"
    common = second.request_body.response
    assert common.clear_route_cache
    assert set_headers(common)["x-inferlb-cluster"] == b"llm-v2"
    assert set_headers(common)["x-gateway-destination-endpoint"].startswith(b"10.0.2.")


@pytest.mark.parametrize("headers", [
    {"model_version": "v1", "x_session_id": "a", "x_inferlb_request_class": "small"},  # the headers say it all
    {"content_type": "text/plain"},  # not JSON
    {"content_length": "4097", "model_version": "v1"},  # above body_max_bytes, the version in a header
])
def test_handler_decides_at_headers_when_the_body_cannot_help(headers):
    answer, end = handler().process(StreamState(), headers_msg(False, **headers))
    assert end and pb.ProcessingResponse.FromString(answer).WhichOneof("response") == "request_headers"


@pytest.mark.parametrize("kind", ["application/json", "Application/JSON", "APPLICATION/JSON; charset=utf-8",
                                  "application/vnd.api+json", ""])
def test_a_json_media_type_is_json_in_any_case(kind):
    """Media types are case-insensitive (RFC 9110 8.3.1): the body's ``model`` chooses the version.
    No content type (empty) is JSON too, as FastAPI (vLLM's, SGLang's server) parses it."""
    h, stream = handler(), StreamState()
    answer, end = h.process(stream, headers_msg(False, content_type=kind))
    assert not end and pb.ProcessingResponse.FromString(answer).HasField("mode_override")
    body = json.dumps({"model": "v2", "messages": []}).encode()
    answer, _ = h.process(stream, message("request_body", body=body, end_of_stream=True))
    common = pb.ProcessingResponse.FromString(answer).request_body.response
    assert set_headers(common)["x-inferlb-cluster"] == b"llm-v2"


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_of_another_media_type_is_not_read(kind):
    """The backend does not parse it as JSON either (FastAPI: 422): routed by its headers."""
    answer, end = handler().process(StreamState(), headers_msg(False, content_type=kind))
    assert end and not pb.ProcessingResponse.FromString(answer).HasField("mode_override")


def test_a_json_body_is_read_for_the_request_size_when_no_class_header_gives_it():
    answer, end = handler().process(StreamState(), headers_msg(False, model_version="v1", x_session_id="a"))
    assert not end and pb.ProcessingResponse.FromString(answer).HasField("mode_override")


def test_handler_decides_at_headers_without_a_body():
    answer, end = handler().process(StreamState(), headers_msg(True))
    assert end and not pb.ProcessingResponse.FromString(answer).HasField("mode_override")


def _refusal(answer: bytes) -> str:
    """The 413's message (Envoy's local reply mapper gives it the OpenAI shape: tests/integration)."""
    response = pb.ProcessingResponse.FromString(answer)
    assert response.WhichOneof("response") == "immediate_response"
    assert response.immediate_response.status.code == 413
    return response.immediate_response.body.decode()


def test_a_body_too_large_to_read_is_refused_where_its_model_would_choose_the_version():
    """Above body_max_bytes its ``model`` is not read: routed by headers alone it would go to the
    default version (here the 90/10 mix) whatever model it names, so it gets a 413 saying so, at the
    headers (content-length known) or after a chunked body Envoy buffered whole."""
    text = _refusal(handler().process(StreamState(), headers_msg(False, content_length="4097"))[0])
    assert "4096 bytes" in text and "'model'" in text and "'model-version' header" in text
    h, stream = handler(), StreamState()
    h.process(stream, headers_msg(False))  # chunked: no content-length, held for the body
    answer, end = h.process(stream, message("request_body", body=b"{" + b" " * 5000 + b"}", end_of_stream=True))
    assert end and "picker.body_max_bytes" in _refusal(answer)


def test_a_body_too_large_to_read_still_goes_by_headers_where_the_body_could_not_choose():
    """One version and no model names: the body's ``model`` could not change the version."""
    single = ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity="soft")
    h = PickerHandler(ViewHolder(EndpointView.build(ASSIGN, RoutingTable(services=(single,), body_max_bytes=4096))))
    answer, end = h.process(StreamState(), headers_msg(False, content_length="4097"))
    common = pb.ProcessingResponse.FromString(answer).request_headers.response
    assert end and set_headers(common)["x-inferlb-cluster"] == b"llm-v1"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"x" * 5000, b'{"model": 7, "user": null}'])
def test_unreadable_or_oversized_bodies_fall_back_to_the_headers(body):
    h, stream = handler(), StreamState()
    h.process(stream, headers_msg(False, model_version="v1"))
    answer, end = h.process(stream, message("request_body", body=body, end_of_stream=True))
    response = pb.ProcessingResponse.FromString(answer)
    assert end and set_headers(response.request_body.response)["x-inferlb-cluster"] == b"llm-v1"


STREAMED_VIEW = EndpointView.build(ASSIGN, RoutingTable(services=(MIXED,), body_max_bytes=4096, body_mode="streamed"))


@pytest.mark.parametrize("length", [None, "1000000"])
def test_streamed_body_mode_asks_envoy_for_chunks(length):
    """Whatever the body's size: the picker reads its first chunk."""
    headers = {} if length is None else {"content_length": length}
    answer, _ = PickerHandler(ViewHolder(STREAMED_VIEW)).process(StreamState(), headers_msg(False, **headers))
    mode = pb.ProcessingResponse.FromString(answer).mode_override.request_body_mode
    assert mode == processing_mode_pb2.ProcessingMode.STREAMED


def test_streamed_body_is_decided_on_its_first_chunk_and_later_chunks_pass_unchanged():
    h, stream = PickerHandler(ViewHolder(STREAMED_VIEW)), StreamState()
    h.process(stream, headers_msg(False, content_length="200000"))
    head = json.dumps({"model": "v2", "user": "carol", "max_tokens": 64,
                       "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                    {"role": "user", "content": "x" * 100}]}).encode()[:-40]  # cut mid-message
    answer, end = h.process(stream, message("request_body", body=head, end_of_stream=False))
    first = pb.ProcessingResponse.FromString(answer)
    assert not end and first.WhichOneof("response") == "request_body"
    common = first.request_body.response
    assert common.clear_route_cache and set_headers(common)["x-inferlb-cluster"] == b"llm-v2"
    pinned = set_headers(common)["x-gateway-destination-endpoint"]
    for last in (False, True):
        answer, end = h.process(stream, message("request_body", body=b"y" * 1000, end_of_stream=last))
        assert end == last and pb.ProcessingResponse.FromString(answer) == pb.ProcessingResponse(
            request_body=pb.BodyResponse())
    # The session came from the first bytes ("user"): the same pin as by header.
    assert h.control.sessions.get(next(iter(h.control.sessions._entries))) == pinned.decode()


def test_partial_and_whole_bodies_give_the_same_prefix_key():
    from ext_proc.body import body_fields, partial_fields
    doc = {"model": "v1", "messages": [{"role": "system", "content": "sys " * 50}, {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a " * 500}]}
    raw = json.dumps(doc).encode()
    routing = VIEW.routing
    whole = body_fields(raw, RoutingTable(body_max_bytes=1 << 20))
    partial = partial_fields(raw[:400], len(raw), routing)
    assert partial.prefix == whole.prefix is not None and partial.model == b"v1"
    assert partial.prompt_tokens == len(raw) / routing.chars_per_token


# --- the body is parsed by orjson; the picker reads the same fields as with json ------------------

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]) | _JSON_VALUES,
                                  "content": st.text() | st.lists(st.fixed_dictionaries(
                                      {"type": st.just("text"), "text": st.text() | _JSON_VALUES})) | _JSON_VALUES})
_BODY = st.fixed_dictionaries({}, optional={
    "model": st.text(max_size=12) | _JSON_VALUES, "user": st.text(max_size=12) | _JSON_VALUES,
    "prompt_cache_key": st.text(max_size=12) | _JSON_VALUES,
    "max_tokens": st.integers(-(2**70), 2**70) | _JSON_VALUES, "max_completion_tokens": st.integers(0, 2**70),
    "messages": st.lists(_MESSAGE, max_size=4) | _JSON_VALUES, "prompt": st.text() | st.lists(st.text()),
    "seed": st.integers(-(2**90), 2**90), "temperature": st.floats(allow_nan=True, allow_infinity=True),
    "extra": _JSON_VALUES})


@settings(max_examples=400, deadline=None)
@given(_BODY)
def test_the_picker_reads_the_same_body_fields_as_with_json(body):
    import ext_proc.body as reader
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    routing = RoutingTable(body_max_bytes=1 << 20)
    fast = reader.body_fields(data, routing)
    original, reader.read_json = reader.read_json, json.loads
    try:
        assert fast == reader.body_fields(data, routing)
    finally:
        reader.read_json = original


@pytest.mark.parametrize("data", [
    b'{"temperature": NaN, "model": "v2"}', b'{"x": Infinity}',  # orjson refuses these: json reads them
    b'{"user": "\\ud800", "model": "v2"}',  # a lone surrogate escape
    b'{"model": "v1", "model": "v2"}',  # a repeated key: the last one
    b'{"a": -0, "b": -0.0, "c": 1e400, "d": "\\u00e9"}',
])
def test_read_json_reads_what_json_reads(data):
    assert json.dumps(read_json(data)) == json.dumps(json.loads(data))


def test_read_json_differs_from_json_only_where_the_picker_does_not_look():
    assert read_json(b'{"seed": 123456789012345678901234567890}') == {"seed": 1.2345678901234568e29}


def _nested(depth: int, extra: bytes = b"") -> bytes:
    return b'{"model": "v2", ' + extra + b'"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_read_json_reads_up_to_the_depth_limit_and_refuses_deeper():
    """orjson's limit (1 024 levels since 3.9.15; pyproject.toml asks for it) is the picker's: a body
    at the limit is read, one level deeper is refused as too deep, whichever parser refused it."""
    assert read_json(_nested(MAX_JSON_DEPTH))["model"] == "v2"
    with pytest.raises(JsonTooDeep):
        read_json(_nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(JsonTooDeep):  # orjson refuses the NaN first; json then hits its recursion limit
        read_json(_nested(MAX_JSON_DEPTH + 1, b'"t": NaN, '))
    with pytest.raises(JsonTooDeep):
        read_json(_nested(100_000))


@pytest.mark.parametrize("mode", ["buffered", "streamed"])
def test_a_body_nested_too_deeply_is_answered_400_naming_the_limit(mode):
    view = STREAMED_VIEW if mode == "streamed" else VIEW
    h, stream = PickerHandler(ViewHolder(view)), StreamState()
    h.process(stream, headers_msg(False, content_length="3000"))
    deep = b'{"model": "v2", "messages": [' + b"[" * 2000 + b"]" * 2000 + b"]}"
    answer, end = h.process(stream, message("request_body", body=deep, end_of_stream=mode == "buffered"))
    immediate = pb.ProcessingResponse.FromString(answer).immediate_response
    assert end and immediate.status.code == 400 and immediate.details == "inferlb_body_too_deep"
    error = json.loads(immediate.body)["error"]
    assert error["code"] == "body_too_deep" and error["type"] == "invalid_request_error"
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("data", [b'{"model": "v2"', b'\xff{}', b"", b"{} {}"],
                         ids=["truncated", "not-utf-8", "empty", "two-documents"])
def test_read_json_refuses_what_json_refuses(data):
    with pytest.raises(ValueError):
        json.loads(data)
    with pytest.raises(ValueError):
        read_json(data)


def test_a_lone_surrogate_in_a_body_field_is_an_answer_not_a_failed_pick():
    """JSON may carry a lone surrogate, which strict UTF-8 cannot encode: a ``user`` with one still
    keys the session and the body's ``model`` still chooses the version; a ``model`` with one is no
    version string (400, param ``model``). Before, the encode raised in the pick and Envoy's fallback
    served the default version."""
    h, stream = handler(), StreamState()
    h.process(stream, headers_msg(False))
    body = b'{"model": "v2", "user": "\\ud800", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    answer, end = h.process(stream, message("request_body", body=body, end_of_stream=True))
    assert end and set_headers(pb.ProcessingResponse.FromString(answer).request_body.response)[
        "x-inferlb-cluster"] == b"llm-v2"
    named = ServiceRoute("llm", ("*",), "stable", {"v1": "llm-v1", "v2": "llm-v2"}, mixes=MIXED.mixes,
                         models=frozenset({b"sim-7b"}), affinity="soft")
    h = PickerHandler(ViewHolder(EndpointView.build(ASSIGN, RoutingTable(services=(named,), body_max_bytes=4096))))
    stream = StreamState()
    h.process(stream, headers_msg(False))
    answer, _ = h.process(stream, message("request_body", body=b'{"model": "\\u0000\\ud800"}', end_of_stream=True))
    response = pb.ProcessingResponse.FromString(answer)
    assert response.immediate_response.status.code == 400
    assert json.loads(response.immediate_response.body)["error"]["param"] == "model"


def test_a_size_header_the_picker_cannot_use_is_counted_and_logged_not_ignored_silently(caplog):
    """A class no ``request_classes`` entry names, or a memory header that is no MiB: the request is
    sized without it, as before, and the problem is counted by kind and logged naming the header."""
    from prometheus_client import REGISTRY

    from ext_proc.view import RequestClass

    routing = RoutingTable(services=(MIXED,), body_max_bytes=0, request_memory_header="x-mem",
                           request_classes={"small": RequestClass(1000.0, 100.0, 10.0)})
    h = PickerHandler(ViewHolder(EndpointView.build(ASSIGN, routing)))

    def count(kind: str) -> float:
        return REGISTRY.get_sample_value("inferlb_ext_proc_errors_total", {"kind": kind}) or 0.0

    before = count("request-class-unknown"), count("request-memory-invalid")
    for headers in ({"x_inferlb_request_class": "small", "x_mem": "512"}, {}):   # usable, or none: no report
        answer, end = h.process(StreamState(), headers_msg(True, **headers))
        assert end
    assert (count("request-class-unknown"), count("request-memory-invalid")) == before
    h.process(StreamState(), headers_msg(True, x_inferlb_request_class="giant"))
    h.process(StreamState(), headers_msg(True, x_mem="lots"))
    h.process(StreamState(), headers_msg(True, x_mem="-1"))
    assert (count("request-class-unknown"), count("request-memory-invalid")) == (before[0] + 1, before[1] + 2)
    assert "unknown request class 'giant' in header 'x-inferlb-request-class'" in caplog.text
    assert "known: small" in caplog.text and "header 'x-mem' must be MiB >= 0, got 'lots'" in caplog.text
