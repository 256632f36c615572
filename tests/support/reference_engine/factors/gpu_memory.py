"""``gpu_memory``: lowers the weight of an endpoint persistently short of GPU memory for a request.

Short: free GPU memory < ``engine.request_memory_mib x (1 + engine.memory_margin)`` (default
2048 MiB + 20 %); free memory is the stat's ``gpu_mem_free_mib`` (the GPU with the least free), or
the endpoint's GPU memory minus ``gpu_mem_used_mib``; no data: no change. Never an exclusion (see
:mod:`.shortage`): each request's memory is admitted by the picker against the live estimate.
"""

from __future__ import annotations

from tests.support.reference_engine.factors.shortage import shortage_factor
from tests.support.reference_engine.inputs import free_mib, needed_mib
from tests.support.reference_engine.plugin import ClusterRound, Member


def _short(m: Member, rnd: ClusterRound) -> bool | None:
    free = free_mib(m)
    return None if free is None else free < needed_mib(rnd)


PLUGIN = shortage_factor("gpu_memory", _short)
