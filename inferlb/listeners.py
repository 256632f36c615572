"""Binding a listener: a failure is one :class:`BindError` that names the config field (or option),
the address and the OS's reason, so a command can print one line instead of a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

from xds_server.config import split_hostport

__all__ = ["BindError", "binding"]


class BindError(Exception):
    """A listener cannot bind its address; ``str(err)`` names its config field, the address and why
    (``listen.admin 127.0.0.1:18090: address already in use``)."""


def _probe(address: str, reuse_port: bool = False) -> None:
    """Bind ``address`` once and let it go, as our servers bind it (``SO_REUSEADDR``, and
    ``SO_REUSEPORT`` only with ``reuse_port``): raises the ``OSError`` a server would meet there. Like
    gRPC, a host name is bindable when one of the addresses it resolves to is. Port 0 is not probed."""
    host, port = split_hostport(address)
    if port == 0:
        return
    first: OSError | None = None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(sockaddr)
                return
            except OSError as err:
                first = first or err
    if first is not None:
        raise first


def _bind_reason(err: OSError | RuntimeError, address: str, reuse_port: bool) -> str:
    """Why binding ``address`` failed, in the OS's words. grpc's ``RuntimeError`` gives no reason,
    so the address is probed once more here to find it."""
    if isinstance(err, OSError) and err.errno in errno.errorcode:
        return os.strerror(err.errno).lower()   # asyncio's strerror repeats the address
    try:
        _probe(address, reuse_port)
    except OSError as probe_err:
        return (probe_err.strerror or str(probe_err)).lower()
    return f"cannot bind ({err})"


@contextlib.contextmanager
def binding(field: str, address: str, *, reuse_port: bool = False) -> Iterator[None]:
    """Turn a failure to bind ``address`` (the config's ``field``) inside the block into :class:`BindError`.

    The address is probed first (``reuse_port``: the server sets ``SO_REUSEPORT``): a gRPC server
    that cannot bind logs lines of its own to stderr (its C core) before it fails, so a taken
    address is found before the server tries."""
    try:
        _probe(address, reuse_port)
        yield
    except (OSError, RuntimeError) as err:
        raise BindError(f"{field} {address}: {_bind_reason(err, address, reuse_port)}") from err
