"""Load-view helpers for unit tests: a gRPC server (``async with load_view_server(table) as target``)
and a memory round counted inline (:func:`counted`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from xds_server.loadview.rounds import RoundCounts
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


def counted(table: LoadTable) -> RoundCounts:
    """``table``'s latest memory round, counted here on the caller's thread when it is not yet (as the
    load-view server does in its worker thread)."""
    if table.counted.round != table.memory_round:
        table.take_counts(table.round_counter()())
    return table.counted
