"""TLS credentials for the control plane's gRPC servers (ADS, metrics push) from the ``tls`` config section."""

from __future__ import annotations

from pathlib import Path

import grpc

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
