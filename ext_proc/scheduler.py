"""The per-request endpoint choice: soft affinity, weighted bounded loads, memory admission (pure).

For one request of one cluster (its pinnable endpoints and ring precomputed per view) and the live
load the picker keeps (:class:`ext_proc.inflight.InFlight`), :func:`choose` returns the endpoint
and why. The rules, each with its source:

- **Weighted bounded loads.** An endpoint is *under its bound* when its load is below
  ``max(c x (total + work) x w_i / sum(w), min_bound)`` (a session's existing pin uses
  ``pinned_load_factor`` as ``c``): ``total`` is the cluster's load in flight, ``work`` this
  request's, ``w_i`` its EDS weight (capacity carries into pinned traffic). With equal weights and
  unit work this is the bound of Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
  Bounded Loads" (SODA 2018): ``load < c x (total + 1) / n``. The bounds sum to
  ``c x (total + work) > total``, so some endpoint is always under its bound.
- **Memory admission** (the seed rule): an endpoint is a candidate only if its estimated free GPU
  memory (reported free minus the memory of requests sent since that sample) is at least the
  request's need x (1 + margin). Unknown free memory admits.
- **Soft affinity.** A request with a key (a session, or a prefix of its prompt) prefers its
  pinned endpoint (sessions), else the owner of the key's ring position; the preferred endpoint
  is kept while under its bound and admitted for memory, otherwise the request spills to the next
  candidate clockwise on the ring. Without a key, the least loaded (relative to its share)
  admitted endpoint wins.
- **Affinity slack** (``affinity_slack``, typical requests; None: off). Bounded loads compare an
  endpoint with the *average*, so at a few requests per endpoint a pin may hold two or three while
  another endpoint is idle, and every request running beside them decodes slower. With a slack, an
  endpoint is also a candidate only while its load after this request, per share, is within the
  slack of the least loaded admitted endpoint's: ``(load_i + work) / s_i <= min_j (load_j + work) /
  s_j + slack x n`` (``s_i`` its share, ``n`` endpoints; equal shares: at most ``slack`` more
  requests than the least loaded). Keeping a conversation's KV cache is worth a prefill, joining
  a busy batch costs every request in it a slower decode step; the slack says how many requests
  of imbalance a cache hit is worth (the cost model behind Dynamo's KV router and llm-d's
  scorers: prefix overlap against load). Applies to pools up to :data:`SCAN_MAX` endpoints (the
  least load is a scan); larger pools keep the bounded loads alone.
- **Prefix cache.** A request without a pin whose prompt blocks are known (body routing) is placed
  by :func:`ext_proc.prefix_choice.choose_cached`: the share of its prompt the picker's prefix
  index says each endpoint holds against its extra load, or, cached nowhere, the next in weighted
  turn among the not overloaded (pools up to :data:`SCAN_MAX` endpoints). Not where memory
  admission applies to the request (a need and free-memory samples: per-request GPU servers,
  whose scarce resource is memory; engines with a prefix cache hold their KV cache from the start
  and are configured with no per-request memory): there the rules below decide.
- Endpoints whose connections just failed (Envoy's access log: connect failure or reset, issue
  15 item 13) are skipped.

Reasons (a stable label, counted and sampled): ``affinity`` (the preferred endpoint took it),
``spilled`` (it was over its bound: next clockwise), ``memory`` (it lacked memory, or every endpoint
under its bound did: the admitted endpoint with the lowest relative load), ``repinned`` (the pinned
endpoint is gone, unhealthy or failing), ``least-loaded`` (no key), ``no-memory`` (no endpoint can
hold the request: queue or 429).

Deterministic: the same view, loads and request give the same answer in every process.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container, Mapping, Sequence
from typing import Any

from ext_proc.prefix_choice import choose_cached
from ext_proc.prefix_index import PrefixIndex
from ext_proc.view import ClusterEndpoints

__all__ = ["SCAN_MAX", "choose", "pin_after", "under_bound"]

#: Without a key, pools up to this size are scanned for the lowest load per share (O(n)); larger
#: ones use the power of two choices (O(log n)).
SCAN_MAX = 64

_INF = float("inf")
_EMPTY: frozenset[str] = frozenset()


def under_bound(load: float, total: float, work: float, share: float, load_factor: float) -> bool:
    """The weighted bounded-load rule: ``load < c x (total + work) x share``.

    >>> under_bound(0, 0, 1, 0.25, 1.25), under_bound(2, 3, 1, 0.25, 1.25), under_bound(1, 3, 1, 0.25, 1.25)
    (True, False, True)
    """
    return load < load_factor * (total + work) * share


def choose(
    pool: ClusterEndpoints,
    position: int | None,
    pinned: str | None,
    loads: Mapping[str, float],
    total: float,
    work: float = 1.0,
    need_mib: float = 0.0,
    free_mib: Mapping[str, float] | None = None,
    failed: Container[str] = _EMPTY,
    load_factor: float = 1.25,
    margin: float = 0.2,
    spin: int = 0,
    min_bound: float = 0.0,
    pinned_load_factor: float | None = None,
    affinity_slack: float | None = None,
    blocks: Sequence[int] = (),
    index: PrefixIndex | None = None,
) -> tuple[str | None, str]:
    """Choose the endpoint of one request of ``pool`` (non-empty).

    Args:
        pool: the cluster's pinnable endpoints, ring and shares (from the view).
        position: the request key's ring position (64-bit hash), None without a key.
        pinned: the session's pinned endpoint (None: no session or no pin yet).
        loads: ``{endpoint: work in flight}`` (missing = 0); units of a typical request.
        total: the cluster's work in flight.
        work: this request's predicted work (> 0; 1 = a typical request).
        need_mib: this request's GPU memory need (MiB, before the margin); 0 = always admitted.
        free_mib: ``{endpoint: estimated free GPU memory}`` (MiB); missing = unknown = admitted.
        failed: endpoints to skip (recent connect failures or resets).
        load_factor: ``c`` (>= 1).
        margin: the memory margin (0-1 share on top of the need).
        spin: without a key, a 64-bit hash of the request id: its two 32-bit halves draw the two
            choices.
        min_bound: every endpoint's bound is at least this much work (at low load the weighted
            bound is below one request: a conversation's next turn, sent while the completion of
            its previous one is still on its way, would spill).
        pinned_load_factor: ``c`` for a session's existing pin (None: ``load_factor``). Moving an
            established conversation costs its KV cache (its whole history prefilled again),
            placing a new one costs nothing, so the pin gets the looser bound.
        affinity_slack: the affinity slack (typical requests, >= 0; None: off): an endpoint is a
            candidate only within this many requests of the least loaded admitted one (per share).
        blocks, index: the prompt's chained block keys and the picker's prefix index: a request
            without a pin whose blocks are known is placed by :func:`ext_proc.prefix_choice.choose_cached`
            (its cached share against its load) among the endpoints not failing, in pools up to
            :data:`SCAN_MAX` endpoints, unless memory admission applies to it (a need and free
            memory samples: a per-request GPU server, where memory is the scarce resource and
            not a prefix cache); otherwise (or without an index) by the rules above.

    Returns:
        ``(endpoint or None, reason)``; None only with reason ``no-memory``.
    """
    shares = pool.shares
    need = need_mib * (1.0 + margin)
    free = free_mib if (free_mib and need > 0) else None
    if pinned is None and blocks and index is not None and free is None and len(pool.endpoints) <= SCAN_MAX:
        admitted = [e for e in pool.endpoints if e not in failed]
        return choose_cached(blocks, admitted, loads, shares, index, work, min_bound)
    scale = load_factor * (total + work)
    cap = (_INF if affinity_slack is None or len(pool.endpoints) > SCAN_MAX
           else _cap(pool, loads, work, free, need, failed, affinity_slack))

    if pinned is not None:
        if pinned in pool.members and pinned not in failed:
            pinned_scale = (pinned_load_factor or load_factor) * (total + work)
            lp = loads.get(pinned, 0.0)
            if lp < max(pinned_scale * shares[pinned], min_bound) and (
                    free is None or free.get(pinned, _INF) >= need) and (lp + work) / shares[pinned] <= cap:
                return pinned, "affinity"
            endpoint, reason = _walk(pool, position, loads, scale, need, free, failed, pinned, min_bound, work, cap)
            if endpoint is not None and free is not None and free.get(pinned, _INF) < need:
                reason = "memory"
            return endpoint, reason
        walked = _walk(pool, position, loads, scale, need, free, failed, None, min_bound, work, cap)
        return walked[0], ("repinned" if walked[0] is not None and walked[1] in ("affinity", "spilled")
                           else walked[1])
    if position is not None:
        return _walk(pool, position, loads, scale, need, free, failed, None, min_bound, work, cap)
    endpoints = pool.endpoints
    if len(endpoints) <= SCAN_MAX:
        # Small pool: the lowest load per share; ties (an idle pool) drawn by weight from the request id.
        low, tied, tied_share = _INF, [], 0.0
        for e in endpoints:
            if e in failed or (free is not None and free.get(e, _INF) < need):
                continue
            rel = loads.get(e, 0.0) / shares[e]
            if rel < low - 1e-12:
                low, tied, tied_share = rel, [e], shares[e]
            elif rel <= low + 1e-12:
                tied.append(e)
                tied_share += shares[e]
        if not tied:
            return None, "no-memory"
        if len(tied) == 1:
            return tied[0], "least-loaded"
        u = (spin & 0xFFFFFFFF) / 4294967296.0 * tied_share
        for e in tied:
            u -= shares[e]
            if u < 0:
                return e, "least-loaded"
        return tied[-1], "least-loaded"
    # Large pool: the power of two choices (Mitzenmacher 2001), both drawn by weight from the request
    # id's hash; the one with the lower load per share wins (ties: the first draw). O(log n).
    cumulative = pool.cumulative
    last = len(endpoints) - 1
    best, best_load = None, _INF
    for u in ((spin & 0xFFFFFFFF) / 4294967296.0, (spin >> 32 & 0xFFFFFFFF) / 4294967296.0):
        e = endpoints[min(last, bisect_right(cumulative, u))]
        if e in failed or (free is not None and free.get(e, _INF) < need):
            continue
        rel = loads.get(e, 0.0) / shares[e]
        if rel < best_load:
            best, best_load = e, rel
    if best is not None:
        return best, "least-loaded"
    best = _least_relative(pool, loads, free, need, failed, None, memory_only=True)
    return best, ("least-loaded" if best is not None else "no-memory")


def _walk(pool: ClusterEndpoints, position: int | None, loads: Mapping[str, float], scale: float, need: float,
          free: Mapping[str, float] | None, failed: Container[str], skip: str | None, min_bound: float = 0.0,
          work: float = 1.0, cap: float = _INF) -> tuple[str | None, str]:
    """Clockwise from ``position`` (or the ring's start): the first endpoint under its bound and admitted."""
    ring = pool.ring
    owners = ring.owners
    size = len(owners)
    n = len(pool.endpoints)
    i = ring.start_index(position) if position is not None else 0
    shares = pool.shares
    seen: set[str] | None = None
    memory_skipped = False
    first = True
    for _ in range(size):
        e = owners[i]
        if seen is None or e not in seen:
            if e != skip and e not in failed:
                if free is not None and free.get(e, _INF) < need:
                    memory_skipped = True
                elif (le := loads.get(e, 0.0)) < max(scale * shares[e], min_bound) and (le + work) / shares[e] <= cap:
                    if first and skip is None:
                        return e, "affinity"
                    return e, "memory" if memory_skipped else "spilled"
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
    # Nobody is both under its bound and admitted: the admitted endpoint with the lowest relative load.
    best = _least_relative(pool, loads, free, need, failed, skip, memory_only=False)
    if best is None:
        return None, "no-memory"
    return best, "memory"


def _cap(pool: ClusterEndpoints, loads: Mapping[str, float], work: float, free: Mapping[str, float] | None,
         need: float, failed: Container[str], slack: float) -> float:
    """The affinity slack's cap on ``(load + work) / share``: the lowest over the admitted endpoints
    (not failing, memory for the request), plus ``slack`` typical requests on an average endpoint."""
    low = _INF
    shares = pool.shares
    for e in pool.endpoints:
        if e in failed or (free is not None and free.get(e, _INF) < need):
            continue
        r = (loads.get(e, 0.0) + work) / shares[e]
        if r < low:
            low = r
    return low + slack * len(pool.endpoints) + 1e-9


def _least_relative(pool: ClusterEndpoints, loads: Mapping[str, float], free: Mapping[str, float] | None,
                    need: float, failed: Container[str], skip: str | None, memory_only: bool) -> Any:
    best, best_load = None, _INF
    for e in pool.endpoints:
        if e in failed or e == skip and not memory_only:
            continue
        if free is not None and free.get(e, _INF) < need:
            continue
        rel = loads.get(e, 0.0) / pool.shares[e]
        if rel < best_load:
            best, best_load = e, rel
    return best


def pin_after(pinned: str | None, chosen: str, reason: str, spills: int, move_after: int
              ) -> tuple[str, int, bool]:
    """How a session's pin changes after one decision (pure).

    Args:
        pinned: the pin before (None: a new session).
        chosen: the endpoint the request went to.
        reason: the decision's reason.
        spills: the session's spills in a row before this request.
        move_after: spills in a row that move the pin (>= 1; 1 = move at the first spill).

    Returns:
        ``(pin, spills in a row, moved)``: a new session, or one whose pinned endpoint is gone
        (``repinned``), is pinned to ``chosen``; a spill keeps the old pin until ``move_after``
        spills in a row (a burst does not scatter a conversation), then the pin moves there.

    >>> pin_after("a", "b", "spilled", 0, 3), pin_after("a", "b", "spilled", 2, 3)
    (('a', 1, False), ('b', 0, True))
    >>> pin_after("a", "a", "affinity", 2, 3)
    ('a', 0, False)
    """
    if pinned is None or pinned == chosen:
        return chosen, 0, False
    if reason in ("spilled", "memory"):
        spills += 1
        if spills >= move_after:
            return chosen, 0, True
        return pinned, spills, False
    return chosen, 0, True
