"""An asyncio event loop on the lab's virtual clock, for inferlb code that waits on futures and timers.

The picker's memory grant wait (``RequestControl._confirm``: :mod:`ext_proc.requestcontrol`) reads the
running event loop: its time, a future for the answer, a timer for the answer's timeout. The lab runs
no event loop and no threads; :class:`VirtualLoop` gives that code the virtual clock instead: a future
is an ordinary :class:`asyncio.Future` bound to it, a callback (a future's done callbacks, a timer) is
queued, and the caller runs what is due (:meth:`VirtualLoop.run_due`) whenever the harness calls it.
Only what such code uses is implemented (time, futures, ``call_soon``, ``call_later``/``call_at``);
the rest is :class:`asyncio.AbstractEventLoop`'s ``NotImplementedError``. An exception in a callback
is raised to the caller of :meth:`run_due`, never logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["VirtualLoop"]


class VirtualLoop(asyncio.AbstractEventLoop):
    """An event loop whose time is ``clock()`` (virtual s) and which runs callbacks only in :meth:`run_due`.

    Code that calls :func:`asyncio.get_running_loop` must run inside :meth:`running`.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._ready: deque[asyncio.Handle] = deque()
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._order = itertools.count()

    # --- what asyncio's futures and the picker's code call ------------------------------------------

    def time(self) -> float:
        return self._clock()

    def get_debug(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return False

    def is_running(self) -> bool:
        return True

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: Any = None) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: Any = None) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._order), handle))
        return handle

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any,
                   context: Any = None) -> asyncio.TimerHandle:
        return self.call_at(self.time() + delay, callback, *args, context=context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        """A timer was cancelled (it stays in the heap and is skipped)."""

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, BaseException):
            raise error
        raise RuntimeError(context.get("message", "an error in a virtual-loop callback"))

    # --- the lab's side -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[VirtualLoop]:
        """This loop is the running loop of the thread meanwhile (the one before it, if any, after)."""
        before = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        try:
            yield self
        finally:
            asyncio.events._set_running_loop(before)

    def run_due(self) -> None:
        """Run the queued callbacks, and the timers due at ``clock()`` in time order (each followed by
        the callbacks it queued), until nothing is due."""
        now = self._clock()
        while True:
            while self._ready:
                handle = self._ready.popleft()
                if not handle.cancelled():
                    handle._run()
            timers = self._timers
            while timers and timers[0][2].cancelled():
                heapq.heappop(timers)
            if not timers or timers[0][0] > now:
                return
            heapq.heappop(timers)[2]._run()

    def next_timer_s(self) -> float | None:
        """When the earliest timer not cancelled is due (virtual s), None without one."""
        timers = self._timers
        while timers and timers[0][2].cancelled():
            heapq.heappop(timers)
        return timers[0][0] if timers else None
