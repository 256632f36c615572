"""The grpcio transport (grpc.aio): ext_proc and the access-log service on one port.

Envoy is configured to send request headers only. For each stream the servicer reads the
request headers, calls :func:`ext_proc.picker.pick` on the current view and answers with
either header mutations (cluster header, override-host header, ``clear_route_cache``) or an
immediate rejection (see :mod:`ext_proc.responses`), then ends the stream: Envoy half-closes it
about 1 ms after the answer anyway (docs/envoy-facts.md, "How long the ext_proc stream lives").

The same server answers ``envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs``: Envoy
logs each finished request there, and because the access logger names the same cluster as the
ext_proc filter, each Envoy worker's completions arrive over the connection its picks came from.
The decisions themselves are made by :class:`ext_proc.handler.PickerHandler`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ext_proc.transport.base import (
    GRPC_INTERNAL,
    GRPC_INVALID_ARGUMENT,
    MAX_MESSAGE_BYTES,
    Service,
    StreamError,
    StreamState,
)

__all__ = ["ExtProcServicer", "add_servicer", "start_ext_proc_server"]

log = logging.getLogger(__name__)

_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_ALS_SERVICE = "envoy.service.accesslog.v3.AccessLogService"


_STATUS = {GRPC_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT, GRPC_INTERNAL: grpc.StatusCode.INTERNAL}


def _identity(data: bytes) -> bytes:
    return data


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """``ExternalProcessor`` and ``AccessLogService`` on grpc.aio, answering through a handler.

    ``Process`` yields already serialized ``ProcessingResponse`` bytes, so register the servicer
    with :func:`add_servicer` (not the generated ``add_ExternalProcessorServicer_to_server``).

    Args:
        handler: the transport-independent picker logic.

    Malformed input never raises out of the servicer: an undecodable message or a failure
    inside the picker is counted in ``inferlb_ext_proc_errors_total{kind}``, logged (rate
    limited) and ends the stream with an error status, so Envoy applies its configured failure
    mode (fail-open with ``failure_mode_allow``).
    """

    def __init__(self, handler: Service) -> None:
        self._handler = handler

    async def Process(
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """Serve one ext_proc stream: each message through the handler until it says the stream is done."""
        stream = StreamState()
        async for data in request_iterator:
            try:
                answer, end = self._handler.process(stream, data)
            except StreamError as err:
                await context.abort(_STATUS[err.code], err.message)
                return
            if isinstance(answer, asyncio.Future):
                answer = await answer  # waiting for admission; cancelled with this task
            if isinstance(answer, list):  # several answers to one message (full duplex body mode)
                for one in answer:
                    yield one
            elif answer is not None:
                yield answer
            if end:
                return

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes:
        """Count the completions of one access-log stream until Envoy closes it."""
        self._handler.access_log_opened()
        try:
            async for data in request_iterator:
                self._handler.access_log(data)
        finally:
            self._handler.access_log_closed()
        return b""


def add_servicer(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server``: garbage-tolerant parsing, pre-serialized answers."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process,
            request_deserializer=_identity,
            response_serializer=_identity,
        )
    }
    als = {
        "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
            servicer.StreamAccessLogs, request_deserializer=_identity, response_serializer=_identity
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),
                                     grpc.method_handlers_generic_handler(_ALS_SERVICE, als)))
    server.add_registered_method_handlers(_SERVICE, handlers)
    server.add_registered_method_handlers(_ALS_SERVICE, als)


async def start_ext_proc_server(
    handler: Service, address: str, *, reuse_port: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Bind and start the ext_proc gRPC server (plaintext HTTP/2, or TLS with ``credentials``).

    Args:
        handler: the picker logic the servicer calls.
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
    add_servicer(ExtProcServicer(handler), server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise RuntimeError(f"ext_proc server could not bind {address}")
    await server.start()
    log.info("ext_proc server listening on %s (port %d)", address, port)
    return server, port
