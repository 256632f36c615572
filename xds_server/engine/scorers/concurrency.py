"""``concurrency``: headroom ``1 - (running + queue) / max_concurrency`` (window averages), 0–1."""

from __future__ import annotations

import numpy as np

from xds_server.engine.plugin import Array, ClusterRound, NoParams, score_where, stateless_scorer


def _score(rnd: ClusterRound, _: NoParams) -> Array:
    running, queue = rnd.stat("running"), rnd.stat("queue")
    return score_where(~np.isnan(running),
                       1.0 - (running + np.nan_to_num(queue, nan=0.0)) / rnd.columns.max_concurrency)


PLUGIN = stateless_scorer("concurrency", NoParams, 1.0, _score)
