"""``session-affinity`` (scorer; not in the default profile): 1 for the session's pinned endpoint, 0
for the others.

For profiles with the ``max-score`` picker (the Gateway API Inference Extension's shape, where
session affinity is a scorer weighed against the others); the default profile's ``ring-affinity``
picker keeps a pin by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ext_proc.scheduling.api import NoParams, Request, Score

__all__ = ["SessionAffinity"]


class SessionAffinity:
    """See the module docstring; no parameters."""

    name = "session-affinity"
    Params = NoParams
    default_weight = 1.0

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def score(self, request: Request, endpoints: Sequence[str]) -> list[float]:
        """1 for the pin, 0 elsewhere."""
        pinned = request.pinned
        return [1.0 if e == pinned else 0.0 for e in endpoints]

    def rule(self, request: Request) -> Score | None:
        """:meth:`score` for ``request``; None without a pin (every endpoint alike)."""
        return None if request.pinned is None else partial(self.score, request)
