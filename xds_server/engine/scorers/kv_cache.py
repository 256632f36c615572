"""``kv_cache``: ``1 - KV-cache usage`` (0–1): a nearly full cache means preemptions and recompute."""

from __future__ import annotations

import numpy as np

from xds_server.engine.plugin import Array, ClusterRound, NoParams, score_where, stateless_scorer


def _score(rnd: ClusterRound, _: NoParams) -> Array:
    used = rnd.stat("kv_cache")
    return score_where(~np.isnan(used), 1.0 - used)


PLUGIN = stateless_scorer("kv_cache", NoParams, 0.5, _score)
