"""``bounded-load`` (filter, soft): weighted bounded loads, how far affinity may load one endpoint.

An endpoint is kept while its load is below ``max(c x (total + work) x w_i / sum(w), min_bound)``:
``total`` is the cluster tier's work in flight, ``work`` this request's, ``w_i`` the endpoint's EDS
weight (capacity carries into pinned traffic) and ``c`` the ``load_factor``, or the
``pinned_load_factor`` for the session's existing pin (moving an established conversation costs its
KV cache, its whole history prefilled again; placing a new one costs nothing, so the pin gets the
looser bound). With equal weights and unit work this is the bound of Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018): ``load < c x (total + 1) / n``.
The bounds sum to ``c x (total + work) > total``, so some endpoint is always kept. ``min_bound``
(typical requests): at low load the weighted bound is below one request, and a conversation's next
turn, sent while the completion of its previous one is still on its way, would spill.

Soft: when every endpoint the hard filters keep is over its bound, the picker chooses among those.
A pinned session of a service whose session affinity is ``strict`` (the default) never meets this
filter while its pin is usable (:mod:`ext_proc.scheduling.affinity`): ``pinned_load_factor`` bounds
the pins of ``soft`` services only.
It bounds affinity only: a request without an affinity key is not held anywhere by one (its
endpoint is the least loaded), so this filter keeps every endpoint for it.
"""

from __future__ import annotations

from functools import partial

from pydantic import Field

from ext_proc.scheduling.api import Check, PluginParams, Request

__all__ = ["BoundedLoad", "Params", "under_bound"]


class Params(PluginParams):
    """``load_factor``: the bound's ``c`` (>= 1); ``pinned_load_factor``: ``c`` for a session's existing
    pin (>= 1); ``min_bound``: every endpoint's bound is at least this much work (typical requests)."""

    load_factor: float = Field(1.25, ge=1.0, le=100)
    pinned_load_factor: float = Field(2.0, ge=1.0, le=100)
    min_bound: float = Field(2.0, ge=0, le=1_000_000)


def under_bound(load: float, total: float, work: float, share: float, load_factor: float) -> bool:
    """The weighted bounded-load rule without its floor: ``load < c x (total + work) x share``.

    >>> under_bound(0, 0, 1, 0.25, 1.25), under_bound(2, 3, 1, 0.25, 1.25), under_bound(1, 3, 1, 0.25, 1.25)
    (True, False, True)
    """
    return load < load_factor * (total + work) * share


class BoundedLoad:
    """See the module docstring."""

    name = "bounded-load"
    Params = Params
    soft = True
    outcome = "spilled"
    repins = False

    def __init__(self, params: Params) -> None:
        self.params = params
        self._c, self._pinned_c, self._floor = params.load_factor, params.pinned_load_factor, params.min_bound

    def keep(self, request: Request, endpoint: str) -> bool:
        """``load < max(c x (total + work) x share, min_bound)``; True for a request without a key."""
        if request.position is None:
            return True
        bound = ((self._pinned_c if endpoint == request.pinned else self._c) * (request.total + request.work)
                 * request.pool.shares[endpoint])
        floor = self._floor
        return request.loads.get(endpoint, 0.0) < (bound if bound > floor else floor)

    def rule(self, request: Request) -> Check | None:
        """:meth:`keep` for ``request``; None for a request without a key."""
        return None if request.position is None else partial(self.keep, request)
