"""A load-view gRPC server for unit tests: ``async with load_view_server(table) as target``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from xds_server.loadview.service import add_load_view_servicer
from xds_server.loadview.table import LoadTable


@contextlib.asynccontextmanager
async def load_view_server(table: LoadTable) -> AsyncIterator[str]:
    """Serve ``table``'s load view on a free loopback port; yields ``"127.0.0.1:PORT"``; stops after."""
    server = grpc.aio.server()
    add_load_view_servicer(table)(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
