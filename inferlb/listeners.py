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


def _bind_reason(err: OSError | RuntimeError, address: str) -> str:
    """Why binding ``address`` failed, in the OS's words. grpc's ``RuntimeError`` gives no reason,
    so the address is bound once more here to find it (as grpc does: ``SO_REUSEADDR``)."""
    if isinstance(err, OSError) and err.errno in errno.errorcode:
        return os.strerror(err.errno).lower()   # asyncio's strerror repeats the address
    host, port = split_hostport(address)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as probe_err:
        return (probe_err.strerror or str(probe_err)).lower()
    return f"cannot bind ({err})"


@contextlib.contextmanager
def binding(field: str, address: str) -> Iterator[None]:
    """Turn a failure to bind ``address`` (the config's ``field``) inside the block into :class:`BindError`."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise BindError(f"{field} {address}: {_bind_reason(err, address)}") from err
