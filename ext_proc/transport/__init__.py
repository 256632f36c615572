"""The picker's transports: ``fast`` (a dedicated HTTP/2 server, :mod:`.h2`) and ``grpcio`` (:mod:`.grpcio`).

Both serve the same :class:`~ext_proc.transport.base.Service` and give identical answers; every
caller starts one through :func:`start`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ext_proc import wire
from ext_proc.transport.base import Server, Service, TlsFiles, ssl_context

__all__ = ["KINDS", "start"]

log = logging.getLogger(__name__)

#: Transport names, as ``picker.transport`` and ``inferlb ext-proc --transport`` spell them.
KINDS = ("fast", "grpcio")


async def start(kind: str, service: Service, listen: str, *, tls: TlsFiles | None = None,
                reuse_port: bool = False) -> tuple[Server, int]:
    """Bind and start the ``kind`` transport for ``service`` on ``listen`` (``HOST:PORT``, port 0 = any).

    ``tls``: serve TLS (ALPN ``h2``; mTLS with ``require_client_cert``); ``reuse_port``:
    SO_REUSEPORT, so several picker processes share the port.

    Returns:
        ``(server, bound port)``; stop the server with ``await server.stop(grace_s)``.

    Raises:
        ValueError: unknown ``kind``, or a TLS setting that can't work.
        OSError / ssl.SSLError / RuntimeError: a TLS file can't be read, or the address can't be bound.
    """
    log.info("ext_proc decoders (request headers, access log): %s", wire.DECODER)
    if kind == "fast":
        from ext_proc.transport.h2.server import start_fast_server

        return await start_fast_server(service, listen, reuse_port=reuse_port,
                                       ssl_context=ssl_context(tls) if tls else None)
    if kind == "grpcio":
        import grpc

        from ext_proc.transport.grpcio import start_ext_proc_server

        credentials = None
        if tls is not None:
            ssl_context(tls)  # the same checks as the fast transport, with the same errors
            credentials = grpc.ssl_server_credentials(
                [(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
                root_certificates=Path(tls.ca).read_bytes() if tls.ca else None,
                require_client_auth=tls.require_client_cert)
        return await start_ext_proc_server(service, listen, reuse_port=reuse_port, credentials=credentials)
    raise ValueError(f"unknown picker transport {kind!r}; known: {', '.join(KINDS)}")
