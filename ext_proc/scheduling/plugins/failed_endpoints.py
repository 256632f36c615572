"""``failed-endpoints`` (filter, hard): turns away the endpoints whose connections failed
lately.

An endpoint is failing from a connect failure or reset Envoy's access log reports until
``picker.failure_hold_s`` later (:meth:`ext_proc.inflight.InFlight.failed_now`, issue 15 item 13): a
host that refuses connections is not picked for that long. A session pinned to it moves at once
(``repins``). When no endpoint of any tier is left, :func:`ext_proc.picker.pick` decides again as if
no connection had failed (every endpoint with memory for the request failing is no reason to refuse
it).
Behind a Gateway API gateway the endpoints outside the gateway's subset count as failing
(:class:`ext_proc.gateway.Within`).
"""

from __future__ import annotations

from ext_proc.scheduling.api import Check, NoParams, Request, Without

__all__ = ["FailedEndpoints"]

_new = tuple.__new__  # Without(...) without the named tuple's Python-level __new__


class FailedEndpoints:
    """See the module docstring; no parameters."""

    name = "failed-endpoints"
    Params = NoParams
    soft = False
    outcome = "spilled"
    repins = True

    def __init__(self, params: NoParams) -> None:
        self.params = params

    def keep(self, request: Request, endpoint: str) -> bool:
        """True unless ``endpoint`` is failing."""
        return endpoint not in request.failed

    def rule(self, request: Request) -> Check | None:
        """:class:`~ext_proc.scheduling.api.Without` the failing endpoints; None while none fails."""
        failed = request.failed
        return _new(Without, (failed,)) if failed else None
