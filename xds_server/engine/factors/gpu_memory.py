"""``gpu_memory``: lowers the weight of an endpoint persistently short of memory for a request.

Short, for a per-request server: free GPU memory < ``engine.request_memory_mib x (1 +
engine.memory_margin)`` (default 2048 MiB + 20 %); free memory is the stat's ``gpu_mem_free_mib``
(the GPU with the least free), or the endpoint's GPU memory minus ``gpu_mem_used_mib``.
Short, for an engine with a preallocated KV-cache pool (``VersionConfig.gpu_memory``): its KV-cache
usage (``kv_cache``, window average) >= ``kv_full``; its free GPU memory is not read (vLLM takes
``gpu_memory_utilization`` = 0.9 of the GPU at start: ~90 % used whatever runs). No data: no change.
Never an exclusion (see :mod:`.shortage`): each request's memory is admitted by the picker against
the live estimate, and a KV pool's pressure is its scheduler's (it queues or preempts).

``kv_full`` (default 0.9): one sim ``llm`` A10 engine (Llama-3.1-8B, 29 408 KV tokens) fed Poisson
requests of 1 024 prompt + 128 output tokens, KV usage averaged over the last 60 s of 300 s: 0.80 at
3.0 requests/s (it keeps up: 0.9 waiting on average), 0.956 at 3.5 and 4.0 requests/s (over its
capacity: 49 and 167 waiting, the queue growing). 0.9 lies between the two (docs/engine.md).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from xds_server.engine.factors.shortage import ShortageParams, shortage_factor
from xds_server.engine.inputs import free_mib, needed_mib
from xds_server.engine.plugin import Array, ClusterRound


class Params(ShortageParams):
    """:class:`ShortageParams`, and ``kv_full``: the KV-cache usage (0-1] at or above which an engine
    with a preallocated KV-cache pool counts as short."""

    kv_full: float = Field(0.9, gt=0, le=1)


def _short(rnd: ClusterRound, p: Params) -> Array:
    free, kv = free_mib(rnd), rnd.stat("kv_cache")
    per_request = np.where(np.isnan(free), np.nan, free < needed_mib(rnd))
    pool = np.where(np.isnan(kv), np.nan, kv >= p.kv_full)
    return np.where(rnd.columns.preallocated, pool, per_request)


PLUGIN = shortage_factor("gpu_memory", _short, Params)
