"""The ext_proc transport on grpc.aio: Envoy's request headers in, the picker's decision out.

Envoy is configured to send request headers only. For each stream the servicer reads the
request headers, calls :func:`ext_proc.picker.pick` on the current view and answers with
either header mutations (cluster header, override-host header, ``clear_route_cache``) or an
immediate rejection (see :mod:`ext_proc.responses`), then ends the stream: Envoy half-closes it
about 1 ms after the answer anyway (ENVOY-NOTES, "How long the ext_proc stream lives").
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from ext_proc.picker import pick
from ext_proc.responses import EMPTY_ANSWERS, ResponseEncoder, headers_of
from ext_proc.telemetry import DECISION_SECONDS, DECISIONS, ErrorReporter
from ext_proc.view import ViewHolder

__all__ = ["ExtProcServicer", "MAX_MESSAGE_BYTES", "add_servicer", "start_ext_proc_server"]

log = logging.getLogger(__name__)

_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest gRPC message accepted or sent (64 MiB)."""


def _parse_request(data: bytes) -> pb.ProcessingRequest | None:
    """Deserializer that turns undecodable bytes into None, so the servicer can count them."""
    try:
        return pb.ProcessingRequest.FromString(data)
    except DecodeError:
        return None


def _identity(data: bytes) -> bytes:
    return data


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` answering request headers with a pick.

    ``Process`` yields already serialized ``ProcessingResponse`` bytes, so register the servicer
    with :func:`add_servicer` (not the generated ``add_ExternalProcessorServicer_to_server``).

    Args:
        holder: where the current :class:`~ext_proc.view.EndpointView` is read, once per
            request; the slow loop swaps it.
        errors: the error reporter (default: one logging to this module's logger).

    Malformed input never raises out of the servicer: an undecodable message or a failure
    inside the picker is counted in ``inferlb_ext_proc_errors_total{kind}``, logged (rate
    limited) and ends the stream with an error status, so Envoy applies its configured failure
    mode (fail-open with ``failure_mode_allow``).
    """

    def __init__(self, holder: ViewHolder, errors: ErrorReporter | None = None) -> None:
        self._holder = holder
        self._errors = errors if errors is not None else ErrorReporter(log)
        self._encoder = ResponseEncoder()
        self._outcomes: dict[str, Counter] = {}

    def _count(self, reason: str) -> None:
        child = self._outcomes.get(reason)
        if child is None:
            child = self._outcomes[reason] = DECISIONS.labels(reason)
        child.inc()

    def decide(self, http_headers: pb.HttpHeaders) -> bytes:
        """Answer one request-headers message: the serialized ``ProcessingResponse``.

        Raises:
            Exception: whatever the picker raised (it should not; counted as ``pick-failed``).
        """
        headers = headers_of(http_headers)
        view = self._holder.current
        start = time.perf_counter()
        decision = pick(headers, view)
        DECISION_SECONDS.observe(time.perf_counter() - start)
        self._count(decision.reason)
        return self._encoder.encode(decision, view, headers)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest | None],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """Serve one ext_proc stream: answer the request headers, then end the stream."""
        async for request in request_iterator:
            if request is None:
                self._errors.report("decode", "a ProcessingRequest could not be decoded")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "undecodable ProcessingRequest")
                return
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                try:
                    response = self.decide(request.request_headers)
                except Exception:
                    self._errors.report("pick-failed", "the picker raised", exc_info=True)
                    await context.abort(grpc.StatusCode.INTERNAL, "inferlb picker failed")
                    return
                yield response
                return
            if phase is None:
                self._errors.report("empty-request", "a ProcessingRequest carried no phase")
                continue
            self._errors.report(
                f"unexpected-{phase.replace('_', '-')}",
                f"Envoy sent {phase} (configure request headers only); answered with no change",
            )
            yield EMPTY_ANSWERS[phase]


def add_servicer(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server``: garbage-tolerant parsing, pre-serialized answers."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process,
            request_deserializer=_parse_request,
            response_serializer=_identity,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)


async def start_ext_proc_server(
    holder: ViewHolder, address: str, *, reuse_port: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Bind and start the ext_proc gRPC server (plaintext HTTP/2, or TLS with ``credentials``).

    Args:
        holder: the view holder the servicer reads.
        address: ``"HOST:PORT"``; port 0 picks a free port.
        reuse_port: allow several processes on one port (SO_REUSEPORT). Off by default so a
            second picker on a taken port fails instead of silently sharing it.
        credentials: TLS server credentials (``grpc.ssl_server_credentials``); None = plaintext.

    Returns:
        ``(server, port)``: the started server (stop it with ``await server.stop(grace)``) and
        the port actually bound.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    add_servicer(ExtProcServicer(holder), server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"ext_proc server could not bind {address}")
    await server.start()
    log.info("ext_proc server listening on %s (port %d)", address, port)
    return server, port
