"""Envoy ext_proc messages for the picker, independent of the gRPC transport.

- :func:`headers_of`: a request-headers message -> ``{lower-case name: raw bytes}``.
- :func:`build_response`: a :class:`~ext_proc.picker.Decision` -> ``ProcessingResponse``.
- :class:`ResponseEncoder`: the same, serialized, with routed answers cached per view (building
  a response message costs ~5 µs in Python; a cached answer is a dict read).
- :data:`EMPTY_ANSWERS`: the no-change answer for every other phase, serialized.

Header values are read from and written to ``raw_value``: Envoy leaves ``value`` empty, and a
mutation written into ``value`` silently sets an empty header.
"""

from __future__ import annotations

from collections.abc import Container

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.picker import Decision
from ext_proc.view import EndpointView, RoutingTable

__all__ = ["DESTINATION", "EMPTY_ANSWERS", "GATEWAY_API", "LB_NAMESPACE", "ResponseEncoder", "build_response",
           "headers_of"]

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

GATEWAY_API = "gateway-api"
"""``RoutingTable.protocol`` of the Gateway API Inference Extension's endpoint-picker protocol
(:mod:`ext_proc.gateway`)."""
DESTINATION = "x-gateway-destination-endpoint"
"""That protocol's header and metadata key for the chosen endpoint."""
LB_NAMESPACE = "envoy.lb"
"""That protocol's dynamic-metadata namespace for the chosen endpoint."""

EMPTY_ANSWERS: dict[str, bytes] = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString(),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString(),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString(),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString(),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString(),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString(),
}
"""Phase name (the ``ProcessingRequest.request`` oneof) -> serialized answer changing nothing."""


def headers_of(http_headers: pb.HttpHeaders) -> dict[str, bytes]:
    """Collect an ``HttpHeaders`` message into ``{lower-case name: value bytes}``.

    The value is ``raw_value``, or ``value`` encoded as UTF-8 when ``raw_value`` is empty. When a
    name repeats, the first occurrence wins.
    """
    fields = http_headers.headers.headers
    # As Envoy sends them (lower-case names, every value in raw_value): one comprehension, the
    # first occurrence written last. Anything else takes the field-by-field loop below.
    headers = {h.key: h.raw_value for h in reversed(fields)}
    if all(headers.values()) and "".join(headers).islower():
        return headers
    headers = {}
    for h in fields:
        key = h.key.lower()
        if key not in headers:
            headers[key] = h.raw_value or h.value.encode()
    return headers


def _add_set(mutation: pb.HeaderMutation, name: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = name
    option.header.raw_value = value
    option.append_action = _OVERWRITE


def build_response(
    decision: Decision,
    routing: RoutingTable,
    present: Container[str] = frozenset(),
    phase: str = "request_headers",
) -> pb.ProcessingResponse:
    """Turn a decision into the answer to a request-headers message.

    Args:
        decision: the picker's decision.
        routing: supplies the cluster and override-host header names.
        phase: the message answered, ``"request_headers"`` or (body routing) ``"request_body"``.
        present: lower-case names of the request's headers (a dict's keys will do); a routing
            header the client sent and the picker does not overwrite is removed, so a client
            can never choose a host or cluster (Envoy should strip them earlier too).

    Returns:
        ``immediate_response`` (``status``, JSON ``body`` with content-type
        application/json, ``retry-after`` when the decision has one, ``details`` =
        ``"inferlb_<reason>"``) when the decision rejects;
        otherwise a ``phase`` answer whose mutation sets the cluster header (when a cluster is
        chosen) and the override-host header (when an endpoint is pinned), both in
        ``raw_value`` with OVERWRITE_IF_EXISTS_OR_ADD, with ``clear_route_cache`` set whenever
        headers change. With ``routing.protocol`` gateway-api (the endpoint-picker protocol), the
        pinned endpoint goes in the header ``x-gateway-destination-endpoint`` and in the answer's
        ``dynamic_metadata`` ``{"envoy.lb": {"x-gateway-destination-endpoint": endpoint}}``, the same
        value, and no cluster header is set (the gateway chose the route).
    """
    response = pb.ProcessingResponse()
    if decision.status is not None:
        immediate = response.immediate_response
        immediate.status.code = decision.status
        _add_set(immediate.headers, "content-type", b"application/json")
        if decision.retry_after_s is not None:
            _add_set(immediate.headers, "retry-after", str(decision.retry_after_s).encode())
        immediate.body = decision.body
        immediate.details = "inferlb_" + decision.reason.replace("-", "_")
        return response
    answer = getattr(response, phase)
    answer.SetInParent()  # an empty HeadersResponse / BodyResponse when nothing changes
    common = answer.response
    mutation = common.header_mutation
    if routing.protocol == GATEWAY_API:
        if decision.endpoint is not None:
            _add_set(mutation, DESTINATION, decision.endpoint.encode())
            response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = \
                decision.endpoint
            common.clear_route_cache = True
        return response
    if decision.cluster is not None:
        _add_set(mutation, routing.cluster_header, decision.cluster.encode())
    elif routing.cluster_header in present:
        mutation.remove_headers.append(routing.cluster_header)
    if decision.endpoint is not None:
        _add_set(mutation, routing.override_host_header, decision.endpoint.encode())
    elif routing.override_host_header in present:
        mutation.remove_headers.append(routing.override_host_header)
    if mutation.set_headers or mutation.remove_headers:
        common.clear_route_cache = True
    return response


class ResponseEncoder:
    """Serializes answers, caching routed (non-rejecting) ones for the current view.

    A routed answer depends only on the cluster, the pinned endpoint, which routing headers
    the client sent, and the view's header names, so it is cached under those until the view
    changes (or the cache reaches ``max_entries``). Rejections carry client text and are
    built every time. Not thread-safe: use one per event loop.

    Args:
        max_entries: cache entries kept before the cache is emptied.
    """

    def __init__(self, max_entries: int = 8192) -> None:
        self._view: EndpointView | None = None
        self._cache: dict[tuple[str, str | None, str | None, bool, bool], bytes] = {}
        self._max = max_entries

    def encode(
        self, decision: Decision, view: EndpointView, present: Container[str], phase: str = "request_headers"
    ) -> bytes:
        """Serialized :func:`build_response` of ``decision`` under ``view.routing``."""
        routing = view.routing
        if decision.status is not None:
            return build_response(decision, routing).SerializeToString()
        key = (
            phase,
            decision.cluster,
            decision.endpoint,
            routing.cluster_header in present,
            routing.override_host_header in present,
        )
        if view is not self._view or len(self._cache) >= self._max:
            self._view = view
            self._cache = {}
        else:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
        data = build_response(decision, routing, present, phase).SerializeToString()
        self._cache[key] = data
        return data
