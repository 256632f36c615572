"""TLS credentials for inferlb's gRPC servers (xDS and ext_proc) from the ``tls`` config section."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from ext_proc.transport.server import tls_context

from xds_server.config import ConfigError, TlsConfig


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"tls.{field}: cannot read {path}: {err.strerror}") from None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """gRPC server credentials: the server certificate chain and key (PEM), and with ``ca`` the CA
    client certificates are checked against (required when ``require_client_cert``: mTLS).

    Raises:
        ConfigError: a file can't be read (names the field and path).
    """
    pair = (_read("key", tls.key), _read("cert", tls.cert))
    ca = _read("ca", tls.ca) if tls.ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=tls.require_client_cert)


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The same TLS for the picker's fast transport (an ``ssl.SSLContext``, ALPN ``h2``): certificate
    chain and key, and with ``require_client_cert`` client certificates checked against ``ca`` (mTLS).

    Raises:
        ConfigError: a file can't be read or is not a certificate/key (names the field and path).
    """
    try:
        ctx = tls_context(tls.cert, tls.key)
        if tls.ca:
            ctx.load_verify_locations(tls.ca)
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"tls: cannot load {tls.cert}, {tls.key} or {tls.ca}: {err}") from None
    if tls.require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
