"""The Gateway API Inference Extension's endpoint-picker protocol (``picker.protocol: gateway-api``).

A gateway that routes an HTTPRoute to an InferencePool (Istio, Envoy Gateway, kgateway, GKE) calls
the pool's endpoint picker over ext_proc, and the picker answers as the protocol says
(kubernetes-sigs/gateway-api-inference-extension, ``docs/proposals/004-endpoint-picker-protocol``,
v1.0.0):

- **Destination.** The chosen ``ip:port`` in the request header ``x-gateway-destination-endpoint``
  *and* in the response's ``dynamic_metadata`` under namespace ``envoy.lb``, key
  ``x-gateway-destination-endpoint``, the same value in both (:func:`set_destination`). Gateways read
  the metadata with Envoy's ``override_host`` load-balancing policy (Istio, GKE) or the header with
  an ORIGINAL_DST cluster (Envoy Gateway). The protocol allows a comma list of fallbacks; inferlb
  sends the one endpoint it chose.
- **Subset hint.** A gateway may restrict the candidates: request metadata namespace
  ``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``, a list of ``ip:port``
  (or one comma-separated string, as Envoy's ``header_to_metadata`` writes it; the reference
  picker, ``pkg/lwepp/handlers/request.go``, reads both). The picker chooses only among those
  (:class:`Within`); none of them eligible, or an empty list: 503.
- **No destination.** No ready endpoint: an ``ImmediateResponse`` 503; a request to drop (the
  picker's admission, 429 with ``Retry-After``): 429 (:func:`settle_destination`). What the gateway does when
  the picker itself fails is its ``failureMode`` (``FailOpen``: Envoy's ``failure_mode_allow``).
- **Streaming.** The protocol's gateways configure ext_proc with request and response headers
  SEND and both bodies ``FULL_DUPLEX_STREAMED`` (trailers SEND, as that mode requires): Envoy
  streams the body chunks without waiting for answers and the picker must send the body back
  itself (``StreamedBodyResponse``), after the headers answer (Envoy's ``processing_mode.proto``:
  the server "has to maintain the headers-body-trailers ordering"). :class:`GatewayStream` holds
  the request body until its end (or ``body_max_bytes``), decides, then answers the headers and
  sends the held body back in chunks of at most 64 KiB (the proto's recommended size); later chunks,
  and the response body, go back as they come. Other body modes are answered as Envoy expects them
  (NONE: decided on the headers; BUFFERED / STREAMED: headers answered at once, decided on the body).
- **Completions.** With the response on the stream, a request ends when its response does (the
  last response body chunk, trailers, or headers with ``end_of_stream``): the picker counts it
  finished (:meth:`EndpointPicker.process` calls ``completed``), as Envoy's access log does for the
  ``inferlb`` protocol (which such gateways do not send to the picker).

Header values are read and written in ``raw_value`` (docs/envoy-facts.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container
from typing import Any, NamedTuple, Protocol

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from ext_proc.errors import error_body
from ext_proc.picker import Decision
from ext_proc.responses import DESTINATION, EMPTY_ANSWERS, GATEWAY_API, headers_of
from ext_proc.transport.base import GRPC_INVALID_ARGUMENT, Answer, StreamError, StreamState
from ext_proc.view import EndpointView

__all__ = ["DESTINATION", "GATEWAY_API", "SUBSET_KEY", "SUBSET_NAMESPACE", "EndpointPicker", "GatewayStream",
           "SUBSET_EMPTY", "Within", "echo", "settle_destination", "subset_of"]

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: The largest body chunk sent back in one ``StreamedBodyResponse`` (Envoy's recommended maximum).
CHUNK_BYTES = 64 * 1024

_MODE = processing_mode_pb2.ProcessingMode
NONE, FULL_DUPLEX = _MODE.NONE, _MODE.FULL_DUPLEX_STREAMED


def subset_of(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset hint in ``request.metadata_context``: the ``ip:port`` endpoints the
    picker must choose among, or None when the gateway set none (every endpoint of the pool). A
    list of strings and a comma-separated string are both read; anything else there counts as an
    empty subset (nothing eligible: the request gets a 503, never an endpoint outside the hint)."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        items = []
    return frozenset(e.strip() for item in items for e in item.split(",") if e.strip())


def echo(phase: str, body: bytes, end: bool) -> list[bytes]:
    """``body`` sent back to Envoy in FULL_DUPLEX_STREAMED mode: ``phase`` (``request_body`` or
    ``response_body``) answers whose ``streamed_response`` chunks are at most :data:`CHUNK_BYTES`,
    the last with ``end_of_stream`` = ``end`` (one empty chunk when ``body`` is empty)."""
    out = []
    for start in range(0, max(len(body), 1), CHUNK_BYTES):
        part = body[start:start + CHUNK_BYTES]
        last = start + CHUNK_BYTES >= len(body)
        response = pb.ProcessingResponse()
        streamed = getattr(response, phase).response.body_mutation.streamed_response
        streamed.body = part
        streamed.end_of_stream = end and last
        out.append(response.SerializeToString())
    return out


SUBSET_EMPTY = Decision(None, None, 503, error_body(
    503, "subset-empty", "none of the endpoints in the gateway's subset hint can take this request"), "subset-empty")
"""The 503 when the gateway's subset hint leaves no eligible endpoint (reason "subset-empty")."""


def settle_destination(decision: Decision, subset: frozenset[str] | None) -> Decision:
    """The protocol's answer for a decision: an endpoint (inside ``subset`` when the gateway gave
    one), or a 503 (no ready endpoint, nothing of the subset eligible, or no view yet); rejections
    stay as they are (a 429 when the request is dropped). A request no endpoint has memory for
    (reason ``no-memory``) is left to the picker's memory queue (then 429)."""
    if decision.status is not None or decision.reason == "no-memory":
        return decision
    if decision.endpoint is None:
        reason = "not-ready" if decision.cluster is None else "no-healthy-endpoint"
        where = "yet" if decision.cluster is None else f"in cluster '{decision.cluster}'"
        message = f"no ready endpoint {where} for this request"
    elif subset is not None and decision.endpoint not in subset:
        return SUBSET_EMPTY
    else:
        return decision
    return Decision(None, None, 503, error_body(503, reason, message), reason)


class _Outside:
    """Endpoints to skip: those outside ``subset`` and those failing."""

    __slots__ = ("subset", "failed")

    def __init__(self, subset: frozenset[str], failed: Container[str]) -> None:
        self.subset, self.failed = subset, failed

    def __contains__(self, endpoint: object) -> bool:
        return endpoint not in self.subset or endpoint in self.failed

    def __bool__(self) -> bool:
        return True


class Within:
    """The live load as :func:`ext_proc.picker.pick` reads it, with every endpoint outside ``subset``
    taken as failing (skipped by the scheduler). Where the scheduler, finding every endpoint failing,
    chooses among them all, :func:`settle_destination` turns a choice outside the subset into the 503."""

    __slots__ = ("_loads", "failed")

    def __init__(self, loads: Any, subset: frozenset[str]) -> None:
        self._loads = loads
        self.failed = _Outside(subset, loads.failed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loads, name)


class _Picker(Protocol):
    """What :class:`EndpointPicker` needs of the picker (:class:`ext_proc.handler.PickerHandler`)."""

    def decide(self, headers: dict[str, bytes], view: EndpointView, body: bytes | None, whole: bool,
               subset: frozenset[str] | None, phase: str) -> bytes | asyncio.Future[bytes]: ...


class GatewayStream:
    """One ext_proc stream under the protocol: the body modes Envoy announced (its first message's
    ``protocol_config``; without one, the protocol's FULL_DUPLEX_STREAMED), the held request
    headers, subset and body chunks until the decision, and whether the request was decided."""

    __slots__ = ("request_mode", "response_mode", "headers", "subset", "chunks", "size", "decided")

    def __init__(self, request: pb.ProcessingRequest) -> None:
        config = request.protocol_config if request.HasField("protocol_config") else None
        self.request_mode = config.request_body_mode if config is not None else FULL_DUPLEX
        self.response_mode = config.response_body_mode if config is not None else FULL_DUPLEX
        self.headers: dict[str, bytes] = {}
        self.subset: frozenset[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.decided = False


class _Decided(NamedTuple):
    answer: bytes | asyncio.Future[bytes]
    rejected: bool


def _rejection(answer: bytes) -> bool:
    """Whether a serialized answer is an ``immediate_response`` (field 7, length-delimited: its tag
    byte 0x3A comes first, protobuf writing fields in number order and no lower field being set)."""
    return answer[:1] == b"\x3a"


def _then(answer: bytes | asyncio.Future[bytes], more: list[bytes]) -> Answer | asyncio.Future[Answer]:
    """``answer`` followed by ``more`` (unless it is a rejection: then it alone); a future of that when
    the decision waits (admission)."""
    if not isinstance(answer, asyncio.Future):
        return answer if _rejection(answer) else [answer, *more]
    combined: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future[bytes]) -> None:
        if combined.done():
            return
        if f.cancelled():
            combined.cancel()
        elif f.exception() is not None:
            combined.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            one = f.result()
            combined.set_result(one if _rejection(one) else [one, *more])

    answer.add_done_callback(done)
    combined.add_done_callback(lambda c: answer.cancel() if c.cancelled() else None)
    return combined


class EndpointPicker:
    """The protocol's side of the picker: each ext_proc message of a stream in, the answers out
    (:meth:`process`, the transports' ``Service.process`` contract).

    Args:
        picker: decides each request (:meth:`ext_proc.handler.PickerHandler.decide`).
        completed: called with a request's ``x-request-id`` (None: it had none) when its response
            ended (:meth:`ext_proc.requestcontrol.RequestControl.completed`).
        holder: where the current view is read.
    """

    def __init__(self, picker: _Picker, completed: Callable[[bytes | None], None], holder: Any) -> None:
        self.picker = picker
        self.completed = completed
        self.holder = holder

    def process(self, stream: StreamState, data: bytes) -> tuple[Answer | asyncio.Future[Answer] | None, bool]:
        """Answer one serialized ``ProcessingRequest``.

        Raises:
            StreamError: the message is not a ``ProcessingRequest`` (INVALID_ARGUMENT).
        """
        try:
            request = pb.ProcessingRequest.FromString(data)
        except DecodeError:
            raise StreamError(GRPC_INVALID_ARGUMENT, "undecodable ProcessingRequest") from None
        state: GatewayStream | None = stream.gateway
        if state is None:
            state = stream.gateway = GatewayStream(request)
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            http = request.request_headers
            state.headers = headers_of(http)
            state.subset = subset_of(request)
            view = self.holder.current
            if http.end_of_stream or state.request_mode == NONE or (
                    state.request_mode == FULL_DUPLEX and view.routing.body_max_bytes == 0):
                state.decided = True
                decided = self._decide(state, view, None, True, "request_headers")
                return decided.answer, decided.rejected
            if state.request_mode == FULL_DUPLEX:
                return None, False   # the headers answer waits for the body: nothing to send yet
            return EMPTY_ANSWERS["request_headers"], False   # BUFFERED / STREAMED: decided on the body
        if phase == "request_body":
            return self._request_body(state, request.request_body)
        if phase == "request_trailers":
            trailers = EMPTY_ANSWERS["request_trailers"]
            if state.decided or state.request_mode != FULL_DUPLEX:
                return trailers, False
            # The body ended with trailers (no end_of_stream chunk): decide on what came.
            state.decided = True
            view = self.holder.current
            body = b"".join(state.chunks)
            state.chunks = []
            decided = self._decide(state, view, body, True, "request_headers")
            return _then(decided.answer, [*echo("request_body", body, False), trailers]), decided.rejected
        if phase == "response_headers":
            if request.response_headers.end_of_stream:
                self.completed(state.headers.get("x-request-id"))
            return EMPTY_ANSWERS["response_headers"], False
        if phase == "response_body":
            chunk = request.response_body
            if chunk.end_of_stream:
                self.completed(state.headers.get("x-request-id"))
            if state.response_mode == FULL_DUPLEX:
                return echo("response_body", chunk.body, chunk.end_of_stream), False
            return EMPTY_ANSWERS["response_body"], False
        if phase == "response_trailers":
            self.completed(state.headers.get("x-request-id"))
            return EMPTY_ANSWERS["response_trailers"], False
        return None, False

    def _request_body(self, state: GatewayStream, chunk: pb.HttpBody) -> tuple[Answer | asyncio.Future[Answer],
                                                                                bool]:
        end = chunk.end_of_stream
        if state.request_mode != FULL_DUPLEX:
            if state.decided:
                return EMPTY_ANSWERS["request_body"], False
            state.decided = True   # BUFFERED: the whole body; STREAMED: its first chunk
            decided = self._decide(state, self.holder.current, chunk.body, end, "request_body")
            return decided.answer, decided.rejected
        if state.decided:
            return echo("request_body", chunk.body, end), False
        state.chunks.append(chunk.body)
        state.size += len(chunk.body)
        view = self.holder.current
        if not end and state.size <= view.routing.body_max_bytes:
            return None, False   # held until the body ends (or passes body_max_bytes)
        state.decided = True
        body = b"".join(state.chunks)
        state.chunks = []
        decided = self._decide(state, view, body, end, "request_headers")
        return _then(decided.answer, echo("request_body", body, end)), decided.rejected

    def _decide(self, state: GatewayStream, view: EndpointView, body: bytes | None, whole: bool,
                phase: str) -> _Decided:
        answer = self.picker.decide(state.headers, view, body, whole, state.subset, phase)
        return _Decided(answer, not isinstance(answer, asyncio.Future) and _rejection(answer))
