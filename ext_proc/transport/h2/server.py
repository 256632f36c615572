"""The ``fast`` transport on asyncio: one :class:`~ext_proc.transport.h2.conn.Connection` per socket.

Each read is fed to the connection and its answers leave in one write. Use uvloop for the loop
(``uvloop.run``/``uvloop.install``): it halves the per-read cost of the default loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

from ext_proc.transport.base import Service
from ext_proc.transport.h2.conn import Connection, Limits

__all__ = ["FastServer", "start_fast_server"]

log = logging.getLogger(__name__)


class _Protocol(asyncio.Protocol):
    __slots__ = ("_server", "_transport", "conn")

    def __init__(self, server: FastServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None  # or uvloop's equivalent
        self.conn: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # uvloop's transports are not asyncio.Transport subclasses
        if self._server.tls:
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
                log.warning("TLS client did not negotiate ALPN h2; closing")
                transport.close()
                return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop = asyncio.get_running_loop()
        self.conn = Connection(self._server.handler, self._server.limits, self._write, loop.call_later)
        self._server.protocols.add(self)
        transport.write(self.conn.start())
        if self._server.draining:
            transport.write(self.conn.drain())

    def _write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if self.conn is not None and self.conn.done:
            transport.close()

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            return
        out = conn.receive(data)
        if out:
            self._transport.write(out)
        if conn.closing and conn.done:
            self._transport.close()

    def drain(self) -> None:
        if self.conn is not None:
            self._write(self.conn.drain())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.lost()
        self._server.protocols.discard(self)
        self._transport = None


class FastServer:
    """A running ``fast`` transport. Stop it with :meth:`stop` (graceful drain).

    Attributes:
        handler: the picker logic.
        limits: per-connection limits.
        tls: True when serving TLS.
        port: the bound port.
    """

    def __init__(self, handler: Service, limits: Limits, tls: bool) -> None:
        self.handler = handler
        self.limits = limits
        self.tls = tls
        self.protocols: set[_Protocol] = set()
        self.draining = False
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def stop(self, grace: float | None = 1.0) -> None:
        """Graceful drain: stop accepting, send GOAWAY on every connection, let open streams finish
        for up to ``grace`` seconds (None or 0: close at once), then close what is left."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for protocol in list(self.protocols):
            protocol.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (grace or 0)
        while self.protocols and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for protocol in list(self.protocols):
            if protocol._transport is not None:
                protocol._transport.close()
        if self._server is not None:
            await self._server.wait_closed()


async def start_fast_server(
    handler: Service,
    address: str,
    *,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    limits: Limits | None = None,
) -> tuple[FastServer, int]:
    """Bind and start the ``fast`` transport on ``HOST:PORT`` (port 0: any free port).

    Args:
        handler: the picker logic (shared with the grpcio transport: identical decisions).
        reuse_port: SO_REUSEPORT, so ``--workers N`` processes share the port.
        ssl_context: serve TLS (see :func:`ext_proc.transport.base.ssl_context`); clients must negotiate ALPN ``h2``.
        limits: per-connection limits (default :class:`Limits`).

    Returns:
        ``(server, port)``.

    Raises:
        OSError: the address could not be bound.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, int(port)))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    server = FastServer(handler, limits or Limits(), ssl_context is not None)
    loop = asyncio.get_running_loop()
    server._server = await loop.create_server(lambda: _Protocol(server), sock=sock, ssl=ssl_context)
    server.port = sock.getsockname()[1]
    log.info("ext_proc fast transport listening on %s (port %d%s)", address, server.port,
             ", TLS" if ssl_context else "")
    return server, server.port
