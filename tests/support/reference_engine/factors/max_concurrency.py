"""``max_concurrency``: lowers the weight of an endpoint persistently at its max concurrency.

Short: ``running`` (window average) >= the endpoint's configured ``max_concurrency``; no data: no
change. Never an exclusion (see :mod:`.shortage`): the picker bounds each endpoint's live load.
"""

from __future__ import annotations

from tests.support.reference_engine.factors.shortage import shortage_factor
from tests.support.reference_engine.plugin import ClusterRound, Member


def _short(m: Member, rnd: ClusterRound) -> bool | None:
    running = m.stats.running
    return None if running is None else running >= m.spec.max_concurrency


PLUGIN = shortage_factor("max_concurrency", _short)
