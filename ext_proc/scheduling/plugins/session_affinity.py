"""``session-affinity`` (scorer; not in the default profile): 1 for the session's pinned endpoint, 0
for the others.

For profiles with the ``max-score`` picker (the Gateway API Inference Extension's shape, where
session affinity is a scorer weighed against the others); the default profile's ``ring-affinity``
picker keeps a pin by itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from ext_proc.scheduling.api import NoParams, Request, Score

__all__ = ["SessionAffinity"]


class SessionAffinity:
    """See the module docstring; no parameters."""

    name = "session-affinity"
    Params = NoParams
    default_weight = 1.0

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def prepare(self, request: Request) -> Score | None:
        """1 for the pin, 0 elsewhere; None without a pin."""
        pinned = request.pinned
        if pinned is None:
            return None

        def score(endpoints: Sequence[str]) -> list[float]:
            return [1.0 if e == pinned else 0.0 for e in endpoints]

        return score
