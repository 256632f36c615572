"""``memory``: GPU-memory headroom ``(free - need) / (total - need)``, 0–1.

``need`` is a request plus the margin (``engine.request_memory_mib x (1 + memory_margin)``), ``total``
the endpoint's configured GPU memory, ``free`` as the ``gpu_memory`` factor reads it. Bigger GPUs
score higher, which is why the default weight is small (0.25).
"""

from __future__ import annotations

import numpy as np

from xds_server.engine.inputs import free_mib, needed_mib
from xds_server.engine.plugin import Array, ClusterRound, NoParams, score_where, stateless_scorer


def _score(rnd: ClusterRound, _: NoParams) -> Array:
    free, need = free_mib(rnd), needed_mib(rnd)
    room = rnd.columns.memory_mib - need
    with np.errstate(divide="ignore", invalid="ignore"):  # room <= 0 scores 0 whatever the ratio
        return score_where(~np.isnan(free), np.where(room > 0, (free - need) / room, 0.0))


PLUGIN = stateless_scorer("memory", NoParams, 0.25, _score)
