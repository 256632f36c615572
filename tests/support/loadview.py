"""Load-view helpers for unit tests: a gRPC server (``async with load_view_server(table) as target``)
a memory round counted inline (:func:`counted`), and what a servicer's ``Share`` is called with when a
test calls it directly (:class:`Context`, :func:`reports_from`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from protos import load_view_pb2
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


def others_at(table: LoadTable, picker: str | None, endpoint: str, at: float) -> float:
    """MiB of the pickers other than ``picker`` that a memory sample of ``endpoint`` taken at ``at``
    (monotonic s) holds, as a round of that one sample counts it (:meth:`RoundCounts.others`; the
    round is set on ``table``)."""
    table.set_memory({endpoint: (0.0, at)})
    return counted(table).others(picker).get(endpoint, 0.0)


class Context:
    """The gRPC call context ``LoadViewServicer.Share`` reads: only the peer's name (when it logs a refused report)."""

    def peer(self) -> str:
        return "test"


async def reports_from(queue: asyncio.Queue) -> AsyncIterator[load_view_pb2.LoadReport]:
    """A picker's report stream: every ``LoadReport`` put on ``queue``, in order, never ending."""
    while True:
        yield await queue.get()
