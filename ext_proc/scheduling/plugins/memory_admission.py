"""``memory-admission`` (filter, hard): the seed rule, an endpoint takes a request only if its estimated
free GPU memory is at least the request's need x (1 + margin).

The estimate (:class:`ext_proc.inflight.InFlight`) is the free memory the slow loop last sampled,
minus the memory of the requests the picker sent after that sample, plus that of the requests the
sample saw running that have finished since; unknown free memory (no sample) admits. The margin
(``picker.memory_margin``, default ``engine.memory_margin``, 20 %) is already in the request's
``need_mib``; a need the client declares in ``picker.request_memory_header`` gets none. A refusal
counts apart (outcome ``memory``): the request spills, and when no endpoint of any tier can hold it
the request waits in the queue or gets a 429.
"""

from __future__ import annotations

from ext_proc.scheduling.api import INF, Check, Floor, NoParams, Request

__all__ = ["MemoryAdmission"]

_new = tuple.__new__  # Floor(...) without the named tuple's Python-level __new__ (~0.1 µs a request)


class MemoryAdmission:
    """See the module docstring; no parameters (the margin is the request's: ``picker.memory_margin``)."""

    name = "memory-admission"
    Params = NoParams
    soft = False
    outcome = "memory"
    repins = False

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def keep(self, request: Request, endpoint: str) -> bool:
        """True when ``endpoint``'s estimated free memory (unknown: admitted) is at least the need."""
        free = request.free_mib
        return free is None or free.get(endpoint, INF) >= request.need_mib

    def rule(self, request: Request) -> Check | None:
        """:class:`~ext_proc.scheduling.api.Floor` free memory >= need; None when the request needs no
        memory or no endpoint has a sample."""
        free = request.free_mib
        return _new(Floor, (free, request.need_mib)) if free is not None else None
