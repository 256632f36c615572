"""``max_concurrency``: lowers the weight of an endpoint persistently at its max concurrency.

Short: ``running`` (window average) >= the endpoint's configured ``max_concurrency``; no data: no
change. Never an exclusion (see :mod:`.shortage`): the picker bounds each endpoint's live load.
"""

from __future__ import annotations

import numpy as np

from xds_server.engine.factors.shortage import ShortageParams, shortage_factor
from xds_server.engine.plugin import Array, ClusterRound


def _short(rnd: ClusterRound, _: ShortageParams) -> Array:
    running = rnd.stat("running")
    return np.where(np.isnan(running), np.nan, running >= rnd.columns.max_concurrency)


PLUGIN = shortage_factor("max_concurrency", _short, ShortageParams)
