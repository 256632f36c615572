"""``max-score`` (picker; not in the default profile): the highest weighted sum of the scores among
the endpoints every filter keeps, as the Gateway API Inference Extension's ``MaxScorePicker``.

Ties (totals within 1e-12; loads per share within 1e-12 when ``least-loaded`` is the only scorer)
are drawn by weight from the request id's hash (a request with a key: the first tied endpoint, so
every replica agrees). When the soft filters turn away every endpoint the hard ones keep, the best of
those. With the ``session-affinity`` scorer the pin is weighed against the other scores; the
outcome says what happened to a session's pin: ``affinity`` (kept), ``repinned`` (gone, or turned
away by a filter that ``repins``), ``memory`` / ``spilled`` (turned away by a filter, or outscored);
without a pin, ``least-loaded`` (chosen by the scores); ``no-memory`` when no endpoint is left.
O(endpoints) per request.
"""

from __future__ import annotations

from typing import Any

from ext_proc.scheduling.api import Choice, NoParams, Request, spin
from ext_proc.scheduling.scan import draw, lowest, nothing_left, refusal, soft_active

__all__ = ["MaxScore"]


class MaxScore:
    """See the module docstring; no parameters."""

    name = "max-score"
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def pick(self, request: Request, profile: Any) -> Choice:
        """The best-scored endpoint for ``request`` (see the module docstring)."""
        pool = request.pool
        scores, score_bits = profile.scores(request)
        tied, tied_share = lowest(request, profile, scores, pool.endpoints, pool.shares)
        mask = score_bits or profile.picker_bit
        if not tied and soft_active(request, profile):
            tied, tied_share = lowest(request, profile, scores, pool.endpoints, pool.shares, hard_only=True)
            mask |= profile.soft_bits
        if not tied:
            return nothing_left(request, profile)
        chosen = draw(tied, tied_share, pool.shares, spin(request)) if len(tied) > 1 else tied[0]
        pinned = request.pinned
        if pinned is None:
            return Choice(chosen, "least-loaded", profile.label(mask))
        if chosen == pinned:
            return Choice(chosen, "affinity", profile.label(mask))
        k = refusal(request, profile, pinned) if pinned in pool.members else -2
        if k == -2 or (k >= 0 and profile.filters[k].repins):
            return Choice(chosen, "repinned", profile.label(mask))
        if k >= 0:
            return Choice(chosen, profile.filters[k].outcome, profile.label(mask | profile.filter_bits[k]))
        return Choice(chosen, "spilled", profile.label(mask))
