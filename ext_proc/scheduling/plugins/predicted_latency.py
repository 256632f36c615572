"""``predicted-latency`` (picker): a request whose prompt blocks are known goes where its predicted TTFT,
plus the time its admission adds to the requests running there, is lowest, in ms from the cost model.

For the requests ``prefix-cache`` decides (no session pin, prompt blocks known, no memory admission
to apply, a pool of at most ``scan_max`` endpoints) and once the cost model
(:class:`ext_proc.costmodel.CostModel`, :attr:`Request.costs`) has a ready fit with TTFT data for the
GPU class of every candidate (the endpoints not failing), each candidate ``e`` is priced in ms::

    cost(e) = g x load(e)                       the work ahead of the request's first token
            + (1 - hit(e)) x prefill(prompt)    the prefill it must do there
            + d x load(e)                       what it adds to the requests already running there

``load(e)`` is the endpoint's work in flight (typical requests, :attr:`Request.loads`), ``hit(e)``
the share of the prompt's blocks the prefix index says it holds
(:func:`ext_proc.prefix_choice.hit_shares`, 0-1), and from the fit of the endpoint's GPU class
(:class:`ext_proc.costmodel.Fit`): ``g`` (ms each typical request in flight adds to a new request's
TTFT, :meth:`~ext_proc.costmodel.Fit.queue_ms`), ``prefill(prompt)`` (the prefill of this prompt
uncached, :meth:`~ext_proc.costmodel.Fit.prefill_ms`; both from the TTFT fit on the share of the
prompt the endpoint did not hold, with a load term) and ``d`` (ms
one more request in flight adds to a running request's duration, the duration fit's load
coefficient, taken as 0 when the fit finds it negative). It is the trade of
:meth:`ext_proc.costmodel.CostModel.affinity_slack` made per endpoint, per share of the prompt
cached and with each endpoint's own class: on a mixed cluster a slower class's larger ``g`` prices
its queue higher. The lowest cost among the candidates every filter of the profile keeps wins (the default
profile's soft ``bounded-load``: the linear fit sees no cliff where an engine's KV cache overflows
and it preempts, the bound does; when the filters keep none, among every candidate); ties go to the
highest rendezvous hash of the prompt's first block and the endpoint
(:func:`ext_proc.prefix_choice.rendezvous`), so pickers agree. Outcome ``affinity`` when the chosen
endpoint holds the largest cached share, ``spilled`` otherwise; plugins ``predicted-latency``, with
the filter that turned away an endpoint holding the largest share (``bounded-load+predicted-latency``).

- **Cached nowhere** (no candidate holds any of the prompt): every candidate's prefill is the same,
  and the choice is ``prefix-cache``'s rule's (the next in weighted turn among those not overloaded,
  outcome ``least-loaded``, plugins ``predicted-latency``): on a batching engine a new prompt's TTFT
  is set by the prefills that arrive beside it, which a turn spreads (docs/picker.md, "Prefix-cache
  index").
- **The fit is not ready** (a class with fewer than ``cost_min_samples`` completions, or without
  both hits and misses in its TTFT data, unknown prompt tokens, or ``g + d`` below :data:`MIN_D_MS`:
  load would cost nothing): ``prefix-cache``'s rule decides, and the decision's plugins say so: ``prefix-cache``.
- Every other request (a session, a memory need to admit, a pool above ``scan_max``): as
  ``ring-affinity`` (:class:`ext_proc.scheduling.plugins.ring_affinity.RingAffinity`).

Deterministic: the same index, loads, fits and request give the same answer in every process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ext_proc.prefix_choice import choose_cached, hit_shares, rendezvous
from ext_proc.scheduling.api import Choice, Request
from ext_proc.scheduling.plugins import prefix_cache, ring_affinity
from ext_proc.scheduling.scan import kept, refusal

__all__ = ["FALLBACK_LABEL", "MIN_D_MS", "Params", "PredictedLatency", "latency_costs"]

#: Below this many ms per request in flight (``g + d``), the fit is taken to tell nothing of load (fallback).
MIN_D_MS = 0.01
#: The decision's plugins while the fit is not ready: the rule that decided.
FALLBACK_LABEL = "prefix-cache"


class Params(prefix_cache.Params):
    """``prefix-cache``'s parameters (``floor``, ``worth``: its rule, used while the fit is not ready
    and for prompts cached nowhere; ``scan_max``: pools above it are decided by the ring)."""


def latency_costs(candidates: Sequence[str], loads: Mapping[str, float], hits: Mapping[str, float],
                  classes: Mapping[str, str], fits: Mapping[str, Any], prompt_tokens: float
                  ) -> dict[str, float] | None:
    """Each candidate's cost in ms (see the module docstring), None when a candidate's class has no
    usable fit.

    Args:
        candidates: the endpoints that may take the request.
        loads: ``{endpoint: work in flight}`` (typical requests; missing = 0).
        hits: ``{endpoint: cached share of the prompt}`` (0-1; missing = 0).
        classes: ``{endpoint: GPU class}`` (missing = "").
        fits: ``{GPU class: Fit}`` (:attr:`ext_proc.costmodel.CostModel.fits`).
        prompt_tokens: the prompt's tokens (>= 0).
    """
    out: dict[str, float] = {}
    priced: dict[str, tuple[float, float] | None] = {}
    for e in candidates:
        cls = classes.get(e, "")
        terms = priced.get(cls, ())
        if terms == ():
            fit = fits.get(cls)
            prefill = None if fit is None else fit.prefill_ms(prompt_tokens)
            queue = None if fit is None else fit.queue_ms()
            per_load = None if queue is None else queue + max(0.0, fit.duration[3])
            terms = priced[cls] = (None if prefill is None or per_load is None or per_load < MIN_D_MS
                                   else (per_load, prefill))
        if terms is None:
            return None
        per_load, prefill = terms
        out[e] = per_load * loads.get(e, 0.0) + (1.0 - hits.get(e, 0.0)) * prefill
    return out


class PredictedLatency(ring_affinity.RingAffinity):
    """See the module docstring."""

    name = "predicted-latency"
    Params = Params

    def __init__(self, params: Params) -> None:
        super().__init__(params)
        self._floor, self._worth = params.floor, params.worth

    def pick(self, request: Request, profile: Any) -> Choice:
        """The endpoint for ``request`` (see the module docstring)."""
        blocks, index = request.blocks, request.prefixes
        pool = request.pool
        if not (request.pinned is None and blocks and index is not None and request.free_mib is None
                and len(pool.endpoints) <= self._scan_max):
            return super().pick(request, profile)
        failed = request.failed
        candidates = [e for e in pool.endpoints if e not in failed]
        if not candidates:
            return super().pick(request, profile)
        costs, prompt = request.costs, request.prompt_tokens
        hits = hit_shares(blocks, candidates, index)
        prices = None
        if costs is not None and prompt is not None and costs.fits:
            prices = latency_costs(candidates, request.loads, hits, pool.classes, costs.fits, prompt)
        if prices is not None and hits:
            allowed = kept(request, profile, candidates) or candidates  # none kept: the soft filters give way
            first = blocks[0]
            best = min(allowed, key=lambda e: (prices[e], -rendezvous(first, e)))
            top = max(hits.values())
            if hits.get(best, 0.0) >= top:
                return Choice(best, "affinity", profile.picker_label)
            mask = profile.picker_bit
            turned = next((e for e in candidates if hits.get(e, 0.0) >= top and e not in allowed), None)
            if turned is not None:
                k = refusal(request, profile, turned)
                if k >= 0:
                    mask |= profile.filter_bits[k]
            return Choice(best, "spilled", profile.label(mask))
        endpoint, outcome = choose_cached(blocks, candidates, request.loads, pool.shares, index, request.work,
                                          self._floor, self._worth)
        return Choice(endpoint, outcome, profile.picker_label if prices is not None else FALLBACK_LABEL)

