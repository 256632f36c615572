"""``prefix-cache`` (picker; the default profile's): a request without a pin whose prompt blocks are
known goes where its prefix is cached, priced against load; every other request as ``ring-affinity``.

For a request that has no session pin and whose body gave its prompt's chained block keys
(:attr:`Request.blocks`), in a pool of at most ``scan_max`` endpoints, and to which memory admission
does not apply (no GPU memory need, or no free-memory samples: engines with a prefix cache hold
their KV cache from the start), :func:`ext_proc.prefix_choice.choose_cached` chooses among the
endpoints not failing: the share of the prompt the picker's prefix index
(:class:`ext_proc.prefix_index.PrefixIndex`, :attr:`Request.prefixes`) says each holds against its
extra load (the endpoint a conversation's latest turn went to holding all but the prompt's newest
message: :attr:`Request.continued`, while every filter of the profile keeps that endpoint for the
request), or, cached nowhere, the next in weighted turn among those not overloaded. Outcomes
``affinity`` (the endpoint holding the longest prefix), ``spilled`` (a less cached, less loaded one)
and ``least-loaded`` (cached nowhere). The rule's sources (llm-d's approximate prefix scorer,
SGLang's cache-aware router) and its lab figures are in docs/picker.md ("Prefix-cache index").

Every other request (a session, a per-request GPU server, a pool above ``scan_max``) is decided by
:class:`ext_proc.scheduling.plugins.ring_affinity.RingAffinity`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ext_proc.prefix_choice import HIT_WORTH, choose_cached
from ext_proc.scheduling.api import Choice, Request
from ext_proc.scheduling.plugins import ring_affinity
from ext_proc.scheduling.scan import kept

__all__ = ["Params", "PrefixCache"]


class Params(ring_affinity.Params):
    """``floor``: a whole-prompt hit is worth at least this many typical requests of imbalance (at
    low load a prefix's next request, sent while the previous one runs, must not leave it);
    ``worth``: what a whole-prompt hit is worth, in the candidates' mean loads; ``scan_max`` (also
    ``ring-affinity``'s): pools above this many endpoints are decided by the ring alone."""

    floor: float = Field(2.0, ge=0, le=1_000_000)
    worth: float = Field(HIT_WORTH, ge=0, le=1_000)


class PrefixCache(ring_affinity.RingAffinity):
    """See the module docstring."""

    name = "prefix-cache"
    Params = Params

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self._floor, self._worth = params.floor, params.worth

    def pick(self, request: Request, profile: Any) -> Choice:
        """The endpoint for ``request`` (see the module docstring)."""
        blocks, index = request.blocks, request.prefixes
        if (request.pinned is None and blocks and index is not None and request.free_mib is None
                and len(request.pool.endpoints) <= self._scan_max):
            failed = request.failed
            candidates = [e for e in request.pool.endpoints if e not in failed]
            share = request.continued
            last = index.turn_endpoint(request.position) if share else None
            if last is not None and not kept(request, profile, (last,)):
                last = None  # an inferred hit only within the profile's filters (bounded-load's bound)
            endpoint, outcome = choose_cached(blocks, candidates, request.loads, request.pool.shares, index,
                                              request.work, self._floor, self._worth,
                                              (last, share) if last is not None else None)
            if endpoint is not None:
                return Choice(endpoint, outcome, profile.picker_label)
        return super().pick(request, profile)
