"""``memory``: memory headroom for requests, 0–1 (:func:`~xds_server.engine.inputs.memory_headroom`).

A per-request server: ``(free - need) / (total - need)``, ``need`` a request plus the margin
(``engine.request_memory_mib x (1 + memory_margin)``), ``total`` the endpoint's configured GPU
memory, ``free`` as the ``gpu_memory`` factor reads it; bigger GPUs score higher, which is why the
default weight is small (0.25). An engine with a preallocated KV-cache pool: the pool's free share,
``1 - kv_cache`` (its free GPU memory is ~10 % whatever runs: vLLM takes 0.9 of the GPU at start).
"""

from __future__ import annotations

import numpy as np

from xds_server.engine.inputs import memory_headroom
from xds_server.engine.plugin import Array, ClusterRound, NoParams, score_where, stateless_scorer


def _score(rnd: ClusterRound, _: NoParams) -> Array:
    headroom = memory_headroom(rnd)
    return score_where(~np.isnan(headroom), headroom)


PLUGIN = stateless_scorer("memory", NoParams, 0.25, _score)
