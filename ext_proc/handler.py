"""The picker's request logic, independent of the transport: ext_proc messages in, answers out.

Both transports (``grpcio`` in :mod:`ext_proc.server`, ``fast`` in :mod:`ext_proc.transport`)
call one :class:`PickerHandler`, so they make identical decisions. Everything here runs on the
picker's single event loop and takes no locks; the state it keeps (requests in flight) is only
touched from that loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from ext_proc.accesslog import record_completions
from ext_proc.inflight import InFlight
from ext_proc.picker import pick
from ext_proc.responses import ResponseEncoder, headers_of
from ext_proc.sessions import SessionTable
from ext_proc.telemetry import DECISION_SECONDS, DECISIONS, ErrorReporter
from ext_proc.view import ViewHolder

__all__ = ["PickerHandler"]

log = logging.getLogger(__name__)


class PickerHandler:
    """Answers ext_proc request-headers messages and counts access-log completions.

    Args:
        holder: where the current view is read, once per request.
        inflight: requests in flight, fed by picks and completions (default: a fresh one).
        sessions: the session table (default: 30 min idle TTL, 1 000 000 sessions).
        errors: the error reporter (default: one logging to this module's logger).
    """

    def __init__(self, holder: ViewHolder, inflight: InFlight | None = None,
                 sessions: SessionTable | None = None, errors: ErrorReporter | None = None) -> None:
        self.holder = holder
        self.inflight = inflight if inflight is not None else InFlight()
        self.sessions = sessions if sessions is not None else SessionTable()
        self.errors = errors if errors is not None else ErrorReporter(log)
        self._encoder = ResponseEncoder()
        self._outcomes: dict[str, Counter] = {}

    def _count(self, reason: str) -> None:
        child = self._outcomes.get(reason)
        if child is None:
            child = self._outcomes[reason] = DECISIONS.labels(reason)
        child.inc()

    def request_headers(self, http_headers: pb.HttpHeaders) -> bytes:
        """Answer one request-headers message: the serialized ``ProcessingResponse``.

        A routed request is counted in flight (its cluster, and its endpoint when pinned). The
        ring's bounded loads use the in-flight counts only while an access-log stream is open:
        without completions, picks alone would read as ever-growing load.

        Raises:
            Exception: whatever the picker raised (it should not; transports count it as
                ``pick-failed`` and end the stream with an error so Envoy applies its failure mode).
        """
        headers = headers_of(http_headers)
        view = self.holder.current
        inflight = self.inflight
        start = time.perf_counter()
        decision = pick(headers, view, inflight.endpoints if inflight.streams else None, self.sessions)
        DECISION_SECONDS.observe(time.perf_counter() - start)
        if decision.cluster is not None:
            inflight.picked(decision.cluster, decision.endpoint)
            if decision.session is not None and decision.endpoint is not None:
                self.sessions.touch(decision.session, decision.endpoint)
        self._count(decision.reason)
        return self._encoder.encode(decision, view, headers)

    def access_log(self, data: bytes) -> None:
        """Count the completions in one serialized ``StreamAccessLogsMessage`` (bad input: counted, logged)."""
        routing = self.holder.current.routing
        try:
            record_completions(data, self.inflight, routing.cluster_header, routing.override_host_header)
        except DecodeError:
            self.errors.report("access-log-decode", "a StreamAccessLogsMessage could not be decoded")

    def tick(self) -> None:
        """Housekeeping, about once a second: expire lost picks, forget idle sessions."""
        self.inflight.expire()
        self.sessions.sweep()

    async def maintain(self, interval_s: float = 1.0) -> None:
        """Call :meth:`tick` every ``interval_s`` seconds until cancelled (a failing tick is logged)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick()
            except Exception:  # housekeeping must never stop: the next tick may succeed
                log.exception("picker housekeeping failed")
