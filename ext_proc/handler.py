"""The picker's request logic, independent of the transport: ext_proc messages in, answers out.

Both transports (``grpcio`` in :mod:`ext_proc.transport.grpcio`, ``fast`` in :mod:`ext_proc.transport`)
feed every message of an ext_proc stream to one :class:`PickerHandler`, so they make identical
decisions. Everything here runs on the picker's single event loop and takes no locks; the state
it keeps (requests in flight, sessions) is only touched from that loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from ext_proc.accesslog import CompletionSink, record_completions
from ext_proc.admission import ADMISSION, Admission, admit
from ext_proc.inflight import InFlight
from ext_proc.picker import NO_BODY, BodyFields, Decision, overloaded, pick
from ext_proc.responses import EMPTY_ANSWERS, ResponseEncoder, headers_of
from ext_proc.sampler import DecisionSampler
from ext_proc.sessions import SessionTable
from ext_proc.settings import PickerSettings
from ext_proc.telemetry import DECISION_SECONDS, OUTCOMES, SAMPLE_EVERY, ErrorReporter
from ext_proc.transport.base import GRPC_INTERNAL, GRPC_INVALID_ARGUMENT, StreamError, StreamState
from ext_proc.view import EndpointView, ViewHolder

__all__ = ["PickerHandler"]

log = logging.getLogger(__name__)

_HOLD_FOR_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override={"request_body_mode": "BUFFERED"},
).SerializeToString()


def _body_fields(data: bytes, limit: int) -> BodyFields | None:
    """``model`` and ``user`` of a JSON object body up to ``limit`` bytes; None when unreadable."""
    if len(data) > limit:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    model, user = doc.get("model"), doc.get("user")
    return BodyFields(
        model.encode() if isinstance(model, str) else None,
        user.encode() if isinstance(user, str) else None,
    )


class PickerHandler:
    """Answers ext_proc messages with picks and counts access-log completions.

    Args:
        holder: where the current view is read, once per request.
        inflight: requests in flight, fed by picks and completions (default: a fresh one).
        sessions: the session table (default: 30 min idle TTL, 1 000 000 sessions).
        admission: admission control (None: requests are never held or refused for load).
            It acts only while an access-log stream is open (completions can arrive) and on
            clusters whose endpoints carry a max concurrency.
        errors: the error reporter (default: one logging to this module's logger).
        sampler: where a sample of decisions is kept for operators (None: no sampling).
        completions: where each completion's upstream host, latency and status go (the app keeps
            them as Envoy's view of the endpoints, an engine input; None: not kept).
    """

    def __init__(self, holder: ViewHolder, inflight: InFlight | None = None,
                 sessions: SessionTable | None = None, admission: Admission | None = None,
                 errors: ErrorReporter | None = None, sampler: DecisionSampler | None = None,
                 completions: CompletionSink | None = None) -> None:
        self.holder = holder
        self.inflight = inflight if inflight is not None else InFlight()
        self.sessions = sessions if sessions is not None else SessionTable()
        self.admission = admission
        self.errors = errors if errors is not None else ErrorReporter(log)
        self._encoder = ResponseEncoder()
        self._sample = sampler.offer if sampler is not None else None
        self.completions = completions
        self._timed = 0

    @classmethod
    def from_settings(cls, holder: ViewHolder, settings: PickerSettings,
                      sampler: DecisionSampler | None = None, completions: CompletionSink | None = None
                      ) -> PickerHandler:
        """A handler with the in-flight expiry, session table and admission control of ``settings``."""
        s = settings
        admission = Admission(s.max_queue, s.queue_timeout_s, s.retry_after_s) if s.admission else None
        return cls(holder, InFlight(s.inflight_expiry_s), SessionTable(s.session_ttl_s, s.max_sessions), admission,
                   sampler=sampler, completions=completions)

    @staticmethod
    def _count(reason: str) -> None:
        OUTCOMES[reason] = OUTCOMES.get(reason, 0) + 1

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
            request = pb.ProcessingRequest.FromString(data)
        except DecodeError:
            self.errors.report("decode", "a ProcessingRequest could not be decoded")
            raise StreamError(GRPC_INVALID_ARGUMENT, "undecodable ProcessingRequest") from None
        phase = request.WhichOneof("request")
        try:
            if phase == "request_headers":
                return self._headers(stream, request.request_headers)
            if phase == "request_body" and stream.held is not None:
                headers, stream.held = stream.held, None
                view = self.holder.current
                fields = _body_fields(request.request_body.body, view.routing.body_max_bytes)
                if fields is None:
                    self.errors.report("body-unreadable", "a held body was too large or not a JSON object")
                return self._route(headers, view, fields or NO_BODY, "request_body"), True
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

    def _headers(self, stream: StreamState, http_headers: pb.HttpHeaders) -> tuple[bytes, bool]:
        headers = headers_of(http_headers)
        view = self.holder.current
        if view.routing.body_max_bytes and not http_headers.end_of_stream and self._wants_body(headers, view):
            stream.held = headers
            return _HOLD_FOR_BODY, False
        return self._route(headers, view, NO_BODY, "request_headers"), True

    @staticmethod
    def _wants_body(headers: dict[str, bytes], view: EndpointView) -> bool:
        """A JSON body may name what the headers do not: the version or the session."""
        if b"json" not in headers.get("content-type", b""):
            return False
        routing = view.routing
        if not headers.get(routing.version_header):
            return True
        return not any(headers.get(name) for name in routing.session_headers)

    def _pick(self, headers: dict[str, bytes], view: EndpointView, body: BodyFields) -> Decision:
        inflight = self.inflight
        loads = inflight.endpoints if inflight.streams else None
        self._timed += 1
        if self._timed < SAMPLE_EVERY:
            return pick(headers, view, loads, self.sessions, body)
        self._timed = 0
        start = time.perf_counter()
        decision = pick(headers, view, loads, self.sessions, body)
        DECISION_SECONDS.observe(time.perf_counter() - start)
        return decision

    def _commit(self, decision: Decision, view: EndpointView, headers: dict[str, bytes], phase: str) -> bytes:
        """Count the pick in flight, refresh the session's pin, and encode the answer."""
        if decision.cluster is not None:
            self.inflight.picked(decision.cluster, decision.endpoint)
            if decision.session is not None and decision.endpoint is not None:
                self.sessions.touch(decision.session, decision.endpoint)
        self._count(decision.reason)
        if self._sample is not None:
            self._sample(headers, view.routing, decision)
        return self._encoder.encode(decision, view, headers, phase)

    def _capacity(self, view: EndpointView, cluster: str) -> int:
        pool = view.clusters.get(cluster)
        return pool.capacity if pool is not None else 0

    def _room(self, cluster: str) -> bool:
        return self.inflight.clusters.get(cluster, 0) < self._capacity(self.holder.current, cluster)

    def _route(self, headers: dict[str, bytes], view: EndpointView, body: BodyFields,
               phase: str) -> bytes | asyncio.Future[bytes]:
        decision = self._pick(headers, view, body)
        cluster = decision.cluster
        admission = self.admission
        if cluster is None or admission is None or not self.inflight.streams:
            return self._commit(decision, view, headers, phase)
        verdict = admit(self.inflight.clusters.get(cluster, 0), self._capacity(view, cluster),
                        admission.queued(cluster), admission.max_queue)
        if verdict == "admit":
            return self._commit(decision, view, headers, phase)

        def refuse() -> bytes:
            rejection = overloaded(cluster, admission.retry_after_s)
            self._count(rejection.reason)
            return self._encoder.encode(rejection, view, headers, phase)

        if verdict == "reject":
            ADMISSION.labels(cluster, "rejected_full").inc()
            return refuse()

        def resume() -> bytes:  # a slot is free: decide again on the view and loads of now
            now = self.holder.current
            return self._commit(self._pick(headers, now, body), now, headers, phase)

        return admission.enqueue(cluster, resume, refuse)

    def access_log(self, data: bytes) -> None:
        """Count the completions in one serialized ``StreamAccessLogsMessage`` (bad input: counted, logged)."""
        routing = self.holder.current.routing
        try:
            record_completions(data, self.inflight, routing.cluster_header, routing.override_host_header,
                               self.completions)
        except DecodeError:
            self.errors.report("access-log-decode", "a StreamAccessLogsMessage could not be decoded")
            return
        if self.admission is not None:
            self.admission.release(self._room)

    def access_log_opened(self) -> None:
        """An access-log stream opened: completions can arrive from now on."""
        self.inflight.streams += 1

    def access_log_closed(self) -> None:
        """An access-log stream ended (cleanly or by a reset)."""
        self.inflight.streams -= 1

    def tick(self) -> None:
        """Housekeeping, about once a second: expire lost picks, forget idle sessions."""
        self.inflight.expire()
        self.sessions.sweep()
        if self.admission is not None:
            self.admission.release(self._room)

    async def maintain(self, interval_s: float = 1.0) -> None:
        """Call :meth:`tick` every ``interval_s`` seconds until cancelled (a failing tick is logged)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick()
            except Exception:  # housekeeping must never stop: the next tick may succeed
                log.exception("picker housekeeping failed")
