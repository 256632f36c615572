"""``least-loaded`` (scorer): ``1 / (1 + load / share)`` per endpoint, its work in flight per share of
the cluster's EDS weights (1 idle, lower as it fills; an endpoint with twice the weight holds twice
the work at the same score).

The default profile's only scorer: it chooses the endpoint of a request without an affinity key (the
lowest load per share; ties, such as an idle pool, drawn by weight from the request id), and the
endpoint of a request whose affinity found every endpoint over its bound. Pickers read its rule, a
:class:`~ext_proc.scheduling.api.LoadPerShare`, without a call per endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from ext_proc.scheduling.api import LoadPerShare, NoParams, Request

__all__ = ["LeastLoaded"]

_new = tuple.__new__  # LoadPerShare(...) without the named tuple's Python-level __new__


class LeastLoaded:
    """See the module docstring; no parameters."""

    name = "least-loaded"
    Params = NoParams
    default_weight = 1.0

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def score(self, request: Request, endpoints: Sequence[str]) -> list[float]:
        """``1 / (1 + load / share)`` of each endpoint."""
        return self.rule(request)(endpoints)

    def rule(self, request: Request) -> LoadPerShare:
        """The request's loads over its pool's shares."""
        return _new(LoadPerShare, (request.loads, request.pool.shares))
