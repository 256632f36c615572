"""``idle_compute``: ``1 - GPU utilisation`` (the busiest GPU of the endpoint), 0–1."""

from __future__ import annotations

import numpy as np

from xds_server.engine.plugin import Array, ClusterRound, NoParams, score_where, stateless_scorer


def _score(rnd: ClusterRound, _: NoParams) -> Array:
    util = rnd.stat("gpu_util")
    return score_where(~np.isnan(util), 1.0 - util)


PLUGIN = stateless_scorer("idle_compute", NoParams, 1.0, _score)
