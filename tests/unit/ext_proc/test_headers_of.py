"""``headers_of``: its one-comprehension path for Envoy's usual shape against the field-by-field rule."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.responses import headers_of


def reference(http_headers: pb.HttpHeaders) -> dict[str, bytes]:
    """The documented rule, spelled out: lower-case names, raw_value else value, first wins."""
    out: dict[str, bytes] = {}
    for h in http_headers.headers.headers:
        out.setdefault(h.key.lower(), h.raw_value or h.value.encode())
    return out


names = st.sampled_from([":authority", ":path", "x-session-id", "X-Session-Id", "model-version", "Cookie",
                         "content-type", "x-request-id", "a", "1", ":method"])
values = st.binary(max_size=8)
fields = st.lists(st.tuples(names, st.text(max_size=4), values), max_size=12)


@settings(max_examples=400, deadline=None)
@given(fields)
def test_headers_of_follows_the_rule_for_any_fields(items):
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, value=v, raw_value=r) for k, v, r in items]))
    assert headers_of(message) == reference(message)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["x-a", "x-b", ":path", "model-version"]), values.filter(bool)),
                max_size=8))
def test_headers_of_on_envoys_shape(items):
    """Lower-case names, every value in raw_value (what Envoy sends): the comprehension path."""
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=r) for k, r in items]))
    assert headers_of(message) == reference(message)
