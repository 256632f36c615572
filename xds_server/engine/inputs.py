"""What several plugins read off the members the same way: free GPU memory, a request's need, latency.

Each works on a whole round (float arrays, ``NaN`` = no data)."""

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


def latency_of(rnd: ClusterRound, signal: str) -> Array:
    """The latency each member is judged by (ms): Envoy's view when known, else the backend's;
    ``NaN`` = no data (also for a latency <= 0)."""
    if signal == "p95":
        client, backend = rnd.stat("client_latency_p95_ms"), rnd.stat("latency_p95_ms")
    else:
        client, backend = rnd.stat("client_latency_mean_ms"), rnd.stat("latency_mean_ms")
    v = np.where(np.isnan(client), backend, client)
    return np.where(v > 0, v, np.nan)
