"""``queue``: ``1 / (1 + queue / half_at)`` — 1 with an empty queue, 0.5 at ``half_at`` waiting
requests (default: the endpoint's ``max_concurrency``), towards 0 as the queue grows."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, PluginParams, score_where, stateless_scorer


class Params(PluginParams):
    """``half_at``: queue length (requests) that scores 0.5; ``None`` = the endpoint's max_concurrency."""

    half_at: float | None = Field(None, gt=0)


def _score(rnd: ClusterRound, p: Params) -> Array:
    q = rnd.stat("queue")
    half = p.half_at if p.half_at is not None else rnd.columns.max_concurrency
    return score_where(~np.isnan(q), 1.0 / (1.0 + np.maximum(0.0, q) / half))


PLUGIN = stateless_scorer("queue", Params, 0.5, _score)
