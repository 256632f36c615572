"""What a picker transport serves, and what every transport shares.

A transport (``grpcio`` or the HTTP/2 ``h2`` one) accepts Envoy's connections and hands each gRPC
message to a :class:`Service` (the picker's :class:`~ext_proc.handler.PickerHandler`): ext_proc's
``Process`` stream messages and the access log's ``StreamAccessLogs`` messages. It never looks
inside the service; the service never sees a socket.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ACCESS_LOG_METHOD", "Answer", "GRPC_DEADLINE_EXCEEDED", "GRPC_INTERNAL", "GRPC_INVALID_ARGUMENT", "GRPC_OK",
    "GRPC_RESOURCE_EXHAUSTED", "GRPC_UNAVAILABLE", "GRPC_UNIMPLEMENTED", "MAX_MESSAGE_BYTES", "PROCESS_METHOD",
    "Server", "Service", "StreamError", "StreamState", "TlsFiles", "ssl_context",
]

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOG_METHOD = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"

#: gRPC status codes (grpc/grpc doc/statuscodes.md) the picker's transports and handler send.
GRPC_OK, GRPC_INVALID_ARGUMENT, GRPC_DEADLINE_EXCEEDED, GRPC_RESOURCE_EXHAUSTED = 0, 3, 4, 8
GRPC_UNIMPLEMENTED, GRPC_INTERNAL, GRPC_UNAVAILABLE = 12, 13, 14

MAX_MESSAGE_BYTES = 16 << 20
"""Largest gRPC message a picker transport accepts or sends (16 MiB; a ``ProcessingRequest`` carries
at most the request body Envoy buffers, bounded by ``picker.body_max_bytes``)."""


Answer = bytes | list[bytes]
"""One serialized ``ProcessingResponse``, or several to send in order (Envoy's FULL_DUPLEX_STREAMED
body mode: the deferred headers answer, then the body chunks)."""


class StreamError(Exception):
    """Ends an ext_proc stream with gRPC status ``code`` (an int) and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamState:
    """What one ext_proc stream remembers between messages: request headers held for the body,
    whether the request was decided on its first body chunk (streamed body mode: the later chunks
    only need a no-change answer), and with the endpoint-picker protocol (``picker.protocol:
    gateway-api``) that protocol's state of the stream (:class:`ext_proc.gateway.GatewayStream`)."""

    __slots__ = ("held", "decided", "gateway")

    def __init__(self) -> None:
        self.held: dict[str, bytes] | None = None
        self.decided = False
        self.gateway: Any = None


class Service(Protocol):
    """The picker as a transport sees it."""

    def process(self, stream: StreamState, data: bytes) -> tuple[Answer | asyncio.Future[Answer] | None, bool]:
        """Answer one serialized ``ProcessingRequest``: ``(answer bytes, a list of answers to send in
        order, a future of either, or None; whether the stream ends)``. Raises :class:`StreamError` to
        end the stream with a status."""
        ...

    def access_log(self, data: bytes) -> None:
        """Take one serialized ``StreamAccessLogsMessage`` (never raises)."""
        ...

    def access_log_opened(self) -> None:
        """An access-log stream opened (completions can arrive from now on)."""
        ...

    def access_log_closed(self) -> None:
        """An access-log stream ended (cleanly or not)."""
        ...


class Server(Protocol):
    """A started transport."""

    async def stop(self, grace: float | None) -> None:
        """Stop accepting, let open streams finish for up to ``grace`` seconds, then close."""
        ...


@dataclass(frozen=True)
class TlsFiles:
    """TLS for a picker transport (PEM file paths).

    ``cert``/``key``: the server's chain and key; ``ca``: CA bundle client certificates are checked
    against; ``require_client_cert``: mTLS (needs ``ca``).
    """

    cert: str
    key: str
    ca: str | None = None
    require_client_cert: bool = False


def ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """A server TLS context offering only ALPN ``h2`` (TLS 1.2+), with client certificates checked
    against ``tls.ca`` and required when ``tls.require_client_cert``.

    Raises:
        OSError / ssl.SSLError: a file is missing or not a certificate, key or CA bundle.
        ValueError: ``require_client_cert`` without ``ca``.
    """
    if tls.require_client_cert and not tls.ca:
        raise ValueError("require_client_cert needs a CA bundle (ca)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
    if tls.require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx
