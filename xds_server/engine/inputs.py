"""What several plugins read off the members the same way: free GPU memory, a request's need, the
memory headroom, latency.

Each works on a whole round (float arrays, ``NaN`` = no data).

GPU memory behaves two ways (:attr:`~xds_server.engine.types.EndpointSpec.preallocated`). A
per-request server's free GPU memory is its headroom: a request takes memory of its own. An engine
with a preallocated KV-cache pool (vLLM takes ``gpu_memory_utilization`` = 0.9 of the GPU at start)
shows ~90 % of its GPU used whatever runs, and a request needs no GPU memory beyond KV blocks inside
the pool: its headroom is the pool's free share, ``1 - kv_cache``.
"""

from __future__ import annotations

import numpy as np

from xds_server.engine.plugin import Array, ClusterRound


def free_mib(rnd: ClusterRound) -> Array:
    """Free GPU memory of each member in MiB (``gpu_mem_free_mib``, else its GPU memory minus
    ``gpu_mem_used_mib``, at least 0), ``NaN`` when unknown."""
    free, used = rnd.stat("gpu_mem_free_mib"), rnd.stat("gpu_mem_used_mib")
    return np.where(np.isnan(free), np.maximum(0.0, rnd.columns.memory_mib - used), free)


def needed_mib(rnd: ClusterRound) -> float:
    """Memory one request needs including the margin, MiB."""
    return rnd.engine.request_memory_mib * (1.0 + rnd.engine.memory_margin)


def memory_headroom(rnd: ClusterRound) -> Array:
    """Each member's memory headroom for requests, 0-1 (not clamped), ``NaN`` when unknown: a
    preallocated KV-cache pool's free share ``1 - kv_cache``; a per-request server's
    ``(free - need) / (total - need)`` (:func:`free_mib`, :func:`needed_mib`, ``total`` its GPU
    memory; 0 when a request does not fit in the whole GPU)."""
    free, need = free_mib(rnd), needed_mib(rnd)
    room = rnd.columns.memory_mib - need
    with np.errstate(divide="ignore", invalid="ignore"):  # room <= 0 is 0 whatever the ratio
        per_request = np.where(room > 0, (free - need) / room, np.where(np.isnan(free), np.nan, 0.0))
    return np.where(rnd.columns.preallocated, 1.0 - rnd.stat("kv_cache"), per_request)


def latency_of(rnd: ClusterRound, signal: str) -> Array:
    """The latency each member is judged by (ms): Envoy's view when known, else the backend's;
    ``NaN`` = no data (also for a latency <= 0)."""
    if signal == "p95":
        client, backend = rnd.stat("client_latency_p95_ms"), rnd.stat("latency_p95_ms")
    else:
        client, backend = rnd.stat("client_latency_mean_ms"), rnd.stat("latency_mean_ms")
    v = np.where(np.isnan(client), backend, client)
    return np.where(v > 0, v, np.nan)
