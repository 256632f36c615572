"""``errors``: ``1 - error_rate / tolerance`` (0–1): 1 without errors, 0 at ``tolerance`` (default 20 %)
of requests answered 5xx (an OOM is one). The worse of the backend's and Envoy's view counts."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, PluginParams, score_where, stateless_scorer


class Params(PluginParams):
    """``tolerance``: error rate (0–1] that scores 0."""

    tolerance: float = Field(0.2, gt=0, le=1)


def _score(rnd: ClusterRound, p: Params) -> Array:
    worst = np.fmax(rnd.stat("error_rate"), rnd.stat("client_error_rate"))  # NaN only when both are
    return score_where(~np.isnan(worst), 1.0 - worst / p.tolerance)


PLUGIN = stateless_scorer("errors", Params, 1.0, _score)
