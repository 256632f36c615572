"""FIFO concurrency gate: at most ``limit`` holders run; the rest wait in arrival order."""

from __future__ import annotations

import asyncio
from collections import deque


class ConcurrencyGate:
    """A FIFO, cancellation-safe counting gate.

    ``running`` is the number of holders (0..limit); ``waiting`` the number queued. A released
    slot is handed straight to the oldest waiter, so ``running`` never dips between them.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiters)

    async def acquire(self, front: bool = False) -> None:
        """Wait (FIFO) for a slot; ``front``: queue at the head (a preempted request going back).
        If cancelled, leaves the queue or returns a granted slot."""
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just before the cancel: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Free one slot, handing it to the oldest live waiter if any."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running = max(0, self.running - 1)
