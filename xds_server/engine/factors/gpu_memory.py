"""``gpu_memory``: lowers the weight of an endpoint persistently short of GPU memory for a request.

Short: free GPU memory < ``engine.request_memory_mib x (1 + engine.memory_margin)`` (default
2048 MiB + 20 %); free memory is the stat's ``gpu_mem_free_mib`` (the GPU with the least free), or
the endpoint's GPU memory minus ``gpu_mem_used_mib``; no data: no change. Never an exclusion (see
:mod:`.shortage`): each request's memory is admitted by the picker against the live estimate.
"""

from __future__ import annotations

import numpy as np

from xds_server.engine.factors.shortage import shortage_factor
from xds_server.engine.inputs import free_mib, needed_mib
from xds_server.engine.plugin import Array, ClusterRound


def _short(rnd: ClusterRound) -> Array:
    free = free_mib(rnd)
    return np.where(np.isnan(free), np.nan, free < needed_mib(rnd))


PLUGIN = shortage_factor("gpu_memory", _short)
