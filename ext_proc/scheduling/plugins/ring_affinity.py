"""``ring-affinity`` (picker; the default profile's): soft affinity on a consistent-hash ring, the
scores for requests without a key.

- **A request with a key** (a session, or a prefix of its prompt: :attr:`Request.position`) prefers
  its session's pinned endpoint, else the owner of the key's position on the cluster's ring (160
  points per endpoint). The preferred endpoint is kept while every filter keeps it (outcome
  ``affinity``); otherwise the request goes to the next endpoint clockwise on the ring that every
  filter keeps (``spilled``; ``memory`` when a filter whose refusals count apart, memory admission,
  turned away the pin or an endpoint before it). A pin that is gone (no longer pinnable) or turned
  away by a filter that ``repins`` (failing connections) is replaced by the key's endpoint
  (``repinned``). When the soft filters (bounded loads) turn away every endpoint the hard ones keep,
  the best-scored of those is chosen (the least loaded per share with the default scorer), never a
  pin that was turned away (``memory``).
- **A request without a key**: the best-scored endpoint every filter keeps (``least-loaded``), ties
  (an idle pool) drawn by weight from the request id's hash; above ``scan_max`` endpoints, the power
  of two choices (Mitzenmacher 2001): two endpoints drawn by weight from the request id's two
  32-bit halves, the better-scored wins (ties: the first draw), O(log n).
- ``no-memory`` (endpoint None) when no endpoint is left.

The decision's plugins (:attr:`Choice.plugins`): this picker, plus the filters that turned away the
endpoints it preferred before the one it chose (affinity); the scorers, plus the soft filters then
relaxed (a choice by scores); the filters that turned every endpoint away (none left).

Deterministic: the same view, loads and request give the same answer in every process.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from pydantic import Field

from ext_proc.scheduling.api import INF, SCAN_MAX, Choice, PluginParams, Request, spin
from ext_proc.scheduling.scan import (
    draw,
    kept,
    lowest,
    lowest_first,
    nothing_left,
    refusal,
    soft_active,
    values,
)

__all__ = ["Params", "RingAffinity"]

_new = tuple.__new__


class Params(PluginParams):
    """``scan_max``: pools up to this many endpoints are scanned for the best score of a request
    without a key; larger ones use the power of two choices."""

    scan_max: int = Field(SCAN_MAX, ge=1, le=1_000_000)


class RingAffinity:
    """See the module docstring."""

    name = "ring-affinity"
    Params = Params

    def __init__(self, params: Params) -> None:
        self.params = params
        self._scan_max = params.scan_max

    def pick(self, request: Request, profile: Any) -> Choice:
        """The endpoint for ``request`` (see the module docstring)."""
        pinned = request.pinned
        if pinned is not None:
            if pinned in request.pool.members:
                k = -1
                for i, keep in enumerate(profile.keeps):
                    if not keep(request, pinned):
                        k = i
                        break
                if k < 0:
                    return _new(Choice, (pinned, "affinity", profile.picker_label))
                f = profile.filters[k]
                if not f.repins:
                    choice = _walk(request, profile, pinned, profile.picker_bit | profile.filter_bits[k])
                    if choice.endpoint is not None and f.outcome == "memory":
                        return choice._replace(outcome="memory")
                    return choice
                mask = profile.picker_bit | profile.filter_bits[k]
            else:
                mask = profile.picker_bit
            choice = _walk(request, profile, None, mask)
            if choice.endpoint is not None and choice.outcome in ("affinity", "spilled"):
                return choice._replace(outcome="repinned")
            return choice
        if request.position is not None:
            return _walk(request, profile, None, profile.picker_bit)
        # No key: the best-scored endpoint.
        pool = request.pool
        endpoints = pool.endpoints
        scores, score_bits = profile.scores(request)
        label = profile.label(score_bits or profile.picker_bit)
        if len(endpoints) <= self._scan_max:
            tied, tied_share = lowest(request, profile, scores, endpoints, pool.shares)
            if not tied and soft_active(request, profile):  # every endpoint turned away: the hard filters'
                tied, tied_share = lowest(request, profile, scores, endpoints, pool.shares, hard_only=True)
            if not tied:
                return nothing_left(request, profile)
            chosen = tied[0] if len(tied) == 1 else draw(tied, tied_share, pool.shares, spin(request))
            return _new(Choice, (chosen, "least-loaded", label))
        draws = spin(request)
        cumulative = pool.cumulative
        last = len(endpoints) - 1
        drawn = []
        for u in ((draws & 0xFFFFFFFF) / 4294967296.0, (draws >> 32 & 0xFFFFFFFF) / 4294967296.0):
            e = endpoints[min(last, bisect_right(cumulative, u))]
            if refusal(request, profile, e) < 0:
                drawn.append(e)
        if drawn:
            best, best_value = None, INF
            for e, v in zip(drawn, values(scores)(drawn), strict=True):
                if best is None or v < best_value:
                    best, best_value = e, v
            return _new(Choice, (best, "least-loaded", label))
        best = lowest_first(scores, kept(request, profile, endpoints, hard_only=True))
        return _new(Choice, (best, "least-loaded", label)) if best is not None else nothing_left(request, profile)


def _walk(request: Request, profile: Any, skip: str | None, mask: int) -> Choice:
    """Clockwise from the key's position (or the ring's start): the first endpoint (but ``skip``)
    every filter keeps; none: the best-scored endpoint every hard filter keeps (but ``skip``)."""
    pool = request.pool
    ring = pool.ring
    owners = ring.owners
    size = len(owners)
    n = len(pool.endpoints)
    position = request.position
    i = ring.start_index(position) if position is not None else 0
    keeps, filters, bits = profile.keeps, profile.filters, profile.filter_bits
    seen: set[str] | None = None
    memory = False
    first = True
    for _ in range(size):
        e = owners[i]
        if seen is None or e not in seen:
            if e != skip:
                for k, keep in enumerate(keeps):
                    if not keep(request, e):
                        mask |= bits[k]
                        if filters[k].outcome == "memory":
                            memory = True
                        break
                else:
                    if first and skip is None:
                        return _new(Choice, (e, "affinity", profile.label(mask)))
                    return _new(Choice, (e, "memory" if memory else "spilled", profile.label(mask)))
            first = False
            if seen is None:
                seen = {e}
            else:
                seen.add(e)
            if len(seen) == n:
                break
        i += 1
        if i == size:
            i = 0
    # Nothing every filter keeps: the best-scored endpoint every hard filter keeps.
    scores, score_bits = profile.scores(request)
    best = lowest_first(scores, kept(request, profile, pool.endpoints, hard_only=True, skip=skip))
    if best is None:
        return nothing_left(request, profile)
    return _new(Choice, (best, "memory", profile.label(score_bits | (mask & profile.soft_bits)
                                                       or profile.picker_bit)))
