"""The picker's ext_proc stream protocol, independent of the transport: ext_proc messages in, answers out.

Both transports (``grpcio`` in :mod:`ext_proc.transport.grpcio`, ``fast`` in :mod:`ext_proc.transport`)
feed every message of an ext_proc stream to one :class:`PickerHandler`, so they make identical
decisions. It reads each request's headers and body fields off the stream and hands them to its
:class:`~ext_proc.requestcontrol.RequestControl`, which decides, admits and answers the request and
keeps the state that takes (requests in flight, sessions); access-log completions go to that state
too. Everything here runs on the picker's single event loop and takes no locks; that state is only
touched from that loop.
"""

from __future__ import annotations

import asyncio
import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from ext_proc.accesslog import CompletionSink, record_completions
from ext_proc.admission import Admission
from ext_proc.body import (
    BODY_TOO_LARGE,
    MAX_JSON_DEPTH,
    NO_BODY,
    BodyFields,
    JsonTooDeep,
    body_fields,
    content_length,
    partial_fields,
    unread,
    wants_body,
)
from ext_proc.costmodel import CostModel
from ext_proc.gateway import EndpointPicker
from ext_proc.inflight import InFlight
from ext_proc.picker import header_session_key, size_header_problem, too_deep
from ext_proc.prefix_events import EventIndex
from ext_proc.requestcontrol import RequestControl
from ext_proc.responses import EMPTY_ANSWERS, GATEWAY_API, headers_of
from ext_proc.sampler import DecisionSampler
from ext_proc.sessions import SessionTable
from ext_proc.settings import PickerSettings
from ext_proc.telemetry import ErrorReporter
from ext_proc.transport.base import GRPC_INTERNAL, GRPC_INVALID_ARGUMENT, StreamError, StreamState
from ext_proc.view import EndpointView, ViewHolder
from ext_proc.wire import request_body, request_headers

__all__ = ["PickerHandler"]

log = logging.getLogger(__name__)

_HOLD_FOR_BODY = {
    mode: pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                mode_override={"request_body_mode": mode.upper()}).SerializeToString()
    for mode in ("buffered", "streamed")
}
_BODY_OK = EMPTY_ANSWERS["request_body"]


class PickerHandler:
    """Answers ext_proc messages with picks and counts access-log completions.

    Args:
        holder: where the current view is read, once per request.
        inflight, sessions, admission, sampler, costs, pin_move_after, limit_concurrency, memory_queue,
            retry_after_s: the request control's (:class:`~ext_proc.requestcontrol.RequestControl`,
            :attr:`control`): the live load, the session table, admission control, the decision
            sampler, the request cost model, the spills in a row that move a session's pin, whether
            admission also holds requests at a cluster's max concurrency, whether a request no
            endpoint has memory for waits in the queue, and the ``Retry-After`` of a strict
            session's 429.
        errors: the error reporter (default: one logging to this module's logger).
        completions: where each completion's upstream host, latency and status go (the app keeps
            them as Envoy's view of the endpoints, an engine input; None: not kept).

    Raises:
        ValueError: ``pin_move_after`` is below 1.
    """

    def __init__(self, holder: ViewHolder, inflight: InFlight | None = None,
                 sessions: SessionTable | None = None, admission: Admission | None = None,
                 errors: ErrorReporter | None = None, sampler: DecisionSampler | None = None,
                 completions: CompletionSink | None = None, costs: CostModel | None = None,
                 pin_move_after: int = 3, limit_concurrency: bool = True, memory_queue: bool = True,
                 retry_after_s: int = 1) -> None:
        self.holder = holder
        self.control = RequestControl(holder, inflight, sessions, admission, sampler, costs, pin_move_after,
                                      limit_concurrency, memory_queue, retry_after_s)
        """Decides, admits and answers each request, and keeps the live state (in flight, sessions,
        admission, costs, prefix index)."""
        self.errors = errors if errors is not None else ErrorReporter(log)
        self.completions = completions
        self._route = self.control.route  # bound once: called for every request
        self._gateway = EndpointPicker(self, self.control.completed, holder)

    @classmethod
    def from_settings(cls, holder: ViewHolder, settings: PickerSettings,
                      sampler: DecisionSampler | None = None, completions: CompletionSink | None = None
                      ) -> PickerHandler:
        """A handler with the in-flight expiry, session table, admission control, cost model, pin
        rules and prefix-cache index of ``settings`` (the index of ``prefix_source: kv_events`` is fed
        by the caller's :class:`ext_proc.kv_events.KvEventFeed`)."""
        s = settings
        queues = s.admission or s.memory_queue
        admission = Admission(s.max_queue, s.queue_timeout_s, s.retry_after_s) if queues else None
        handler = cls(holder, InFlight(s.inflight_expiry_s, failure_hold_s=s.failure_hold_s),
                      SessionTable(s.session_ttl_s, s.max_sessions), admission, sampler=sampler,
                      completions=completions, costs=CostModel(s.cost_forget, s.cost_min_samples),
                      pin_move_after=s.pin_move_after, limit_concurrency=s.admission, memory_queue=s.memory_queue,
                      retry_after_s=s.retry_after_s)
        if s.prefix_source == "kv_events":
            handler.control.prefixes = EventIndex(s.pending_s)
        return handler

    def process(self, stream: StreamState, data: bytes) -> tuple[bytes | asyncio.Future[bytes] | None, bool]:
        """Answer one serialized ``ProcessingRequest`` of ``stream``.

        Returns:
            ``(answer, end)``: the serialized ``ProcessingResponse`` to send (None: nothing to
            send; a future: the request waits for admission, send its result when it resolves,
            cancel it if the stream ends first) and whether the stream is then finished (the
            server ends it with status OK).
            Request headers are answered with the decision and end the stream, unless body
            routing holds them for the body (answered with ``mode_override`` BUFFERED; the
            decision then answers the body). Any other phase gets a no-change answer.

        Raises:
            StreamError: undecodable message (INVALID_ARGUMENT) or a failure inside the picker
                (INTERNAL); both counted and logged (rate limited). Envoy then applies its
                failure mode.
        """
        try:
            if self.holder.current.routing.protocol == GATEWAY_API:  # the endpoint-picker protocol (ext_proc.gateway)
                return self._gateway.process(stream, data)
        except StreamError:
            self.errors.report("decode", "a ProcessingRequest could not be decoded")
            raise
        except Exception:
            self.errors.report("pick-failed", "the picker raised", exc_info=True)
            raise StreamError(GRPC_INTERNAL, "inferlb picker failed") from None
        # Envoy's request headers and body without protobuf (ext_proc.wire; None when it is not built).
        decoded = None if request_headers is None else request_headers(data)
        if decoded is not None:
            try:
                return self._headers(stream, *decoded)
            except Exception:
                self.errors.report("pick-failed", "the picker raised", exc_info=True)
                raise StreamError(GRPC_INTERNAL, "inferlb picker failed") from None
        body = None if request_body is None else request_body(data)
        if body is not None:
            phase: str | None = "request_body"
        else:
            try:
                request = pb.ProcessingRequest.FromString(data)
            except DecodeError:
                self.errors.report("decode", "a ProcessingRequest could not be decoded")
                raise StreamError(GRPC_INVALID_ARGUMENT, "undecodable ProcessingRequest") from None
            phase = request.WhichOneof("request")
            if phase == "request_body":
                body = request.request_body.body, request.request_body.end_of_stream
        try:
            if phase == "request_headers":
                http_headers = request.request_headers
                return self._headers(stream, headers_of(http_headers), http_headers.end_of_stream)
            if body is not None:
                answer = self._body(stream, *body)
                if answer is not None:
                    return answer
        except Exception:
            self.errors.report("pick-failed", "the picker raised", exc_info=True)
            raise StreamError(GRPC_INTERNAL, "inferlb picker failed") from None
        if phase is None:
            self.errors.report("empty-request", "a ProcessingRequest carried no phase")
            return None, False
        self.errors.report(
            f"unexpected-{phase.replace('_', '-')}",
            f"Envoy sent {phase} (configure request headers only); answered with no change",
        )
        return EMPTY_ANSWERS[phase], False

    def _body(self, stream: StreamState, body: bytes, end_of_stream: bool
              ) -> tuple[bytes | asyncio.Future[bytes], bool] | None:
        """The answer to a ``request_body`` message (``body``: its bytes; ``end_of_stream``: the body's
        last): the decision for a held request (on the whole body, or on a streamed body's first chunk),
        no change for a later chunk of one decided; None for a body no request waited for."""
        if stream.held is not None:
            headers, stream.held = stream.held, None
            view = self.holder.current
            try:
                # The whole body (buffered, or one streamed chunk); else decided on a streamed body's first
                # bytes, and the later chunks pass unchanged.
                stream.decided = not end_of_stream
                fields = self.read_body(headers, view, body, end_of_stream)
                return self._route(headers, view, fields, "request_body"), end_of_stream
            except JsonTooDeep:
                return self.control.refused(too_deep(MAX_JSON_DEPTH), view, headers, "request_body"), True
        if stream.decided:
            return _BODY_OK, end_of_stream
        return None

    def _headers(self, stream: StreamState, headers: dict[str, bytes], end_of_stream: bool) -> tuple[bytes, bool]:
        view = self.holder.current
        self._check_size_headers(headers, view)
        if view.routing.body_max_bytes and not end_of_stream and wants_body(headers, view.routing):
            length = content_length(headers)
            # A body the picker would not read is not asked for: Envoy would buffer it for nothing,
            # and a BUFFERED body above Envoy's buffer limit (1 MiB) got no answer on Envoy 1.40
            # (measured: none within 15 s). Streamed, the picker reads the first chunk of any body.
            if view.routing.body_mode == "streamed" or length is None or length <= view.routing.body_max_bytes:
                stream.held = headers
                return _HOLD_FOR_BODY[view.routing.body_mode], False
            self.errors.report("body-too-large", "a body above picker.body_max_bytes was not read (routed by "
                               "headers; 413 where its model would choose the version)")
            return self._route(headers, view, BODY_TOO_LARGE, "request_headers"), True
        return self._route(headers, view, NO_BODY, "request_headers"), True

    def _check_size_headers(self, headers: dict[str, bytes], view: EndpointView) -> None:
        """Count and log a size header the request cannot use (:func:`ext_proc.picker.size_header_problem`)."""
        routing = view.routing
        if routing.request_classes or routing.request_memory_header is not None:
            problem = size_header_problem(headers, routing)
            if problem is not None:
                self.errors.report(*problem)

    def read_body(self, headers: dict[str, bytes], view: EndpointView, body: bytes, whole: bool) -> BodyFields:
        """The fields of a held request's JSON body, as the stream reads them (``whole``: all of it; else
        its first bytes; the session headers say whether a prefix key is computed), or what an
        unreadable whole body stands for (reported: ``body-unreadable``). The lab's ``inferlb`` policy
        reads its requests' bodies here too.

        Raises:
            JsonTooDeep: the body (or one of a streamed body's first messages) nests too deep.
        """
        routing = view.routing
        if not whole:
            return partial_fields(body[:routing.body_max_bytes], content_length(headers), routing)
        fields = body_fields(body, routing, header_session_key(headers, routing) is not None)
        if fields is None:
            self.errors.report("body-unreadable", "a held body was too large or not a JSON object")
            return unread(body, routing)
        return fields

    def decide(self, headers: dict[str, bytes], view: EndpointView, body: bytes | None, whole: bool,
               subset: frozenset[str] | None, phase: str) -> bytes | asyncio.Future[bytes]:
        """Decide one request for a protocol module (:mod:`ext_proc.gateway`): ``body`` its JSON body
        (``whole``: all of it; else its first bytes; None: not read), ``subset`` the endpoints it may
        go to (None: any), ``phase`` the message the answer is for. Returns the serialized answer, or
        a future of it (admission)."""
        self._check_size_headers(headers, view)
        try:
            fields = NO_BODY if body is None else self.read_body(headers, view, body, whole)
        except JsonTooDeep:
            return self.control.refused(too_deep(MAX_JSON_DEPTH), view, headers, phase)
        if subset is not None:
            fields = fields._replace(subset=subset)
        return self._route(headers, view, fields, phase)

    def access_log(self, data: bytes) -> None:
        """Count the completions in one serialized ``StreamAccessLogsMessage`` in the request control's
        state (in flight, costs, failing endpoints; waiting requests that now fit go) (bad input:
        counted, logged)."""
        control = self.control
        routing = self.holder.current.routing
        try:
            record_completions(data, control.inflight, routing.cluster_header, routing.override_host_header,
                               self.completions, control.costs, control.failed)
        except DecodeError:
            self.errors.report("access-log-decode", "a StreamAccessLogsMessage could not be decoded")
            return
        control.release()

    def access_log_opened(self) -> None:
        """An access-log stream opened: completions can arrive from now on."""
        self.control.inflight.streams += 1

    def access_log_closed(self) -> None:
        """An access-log stream ended (cleanly or by a reset)."""
        self.control.inflight.streams -= 1

    async def maintain(self, interval_s: float = 1.0) -> None:
        """Call the request control's housekeeping (:meth:`RequestControl.tick
        <ext_proc.requestcontrol.RequestControl.tick>`) every ``interval_s`` seconds until cancelled
        (a failing tick is logged)."""
        tick = self.control.tick
        while True:
            await asyncio.sleep(interval_s)
            try:
                tick()
            except Exception:  # housekeeping must never stop: the next tick may succeed
                log.exception("picker housekeeping failed")
