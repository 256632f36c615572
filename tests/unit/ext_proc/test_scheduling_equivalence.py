"""The default scheduling profile decides as the scheduler it replaced: a differential test.

``old_choose`` below is a frozen copy of ``ext_proc/scheduler.py:choose`` (and its helpers) as it was
at commit c145a78, the last one with that module, kept here only for this comparison. Many seeded
random cases (pools of 1-12 and 60-80 endpoints, random weights, loads, totals, works, memory needs
and estimates, failing endpoints, keys, pins, bound parameters and affinity slacks) are decided by
both, and their endpoints and outcomes must be equal.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Container, Mapping
from typing import Any

import pytest

from ext_proc.ring import HashRing, key_hash
from ext_proc.scheduling import Request, build_profile
from ext_proc.view import ClusterEndpoints

SCAN_MAX = 64
_EMPTY: frozenset[str] = frozenset()


_INF = float("inf")
_EMPTY: frozenset[str] = frozenset()


def under_bound(load: float, total: float, work: float, share: float, load_factor: float) -> bool:
    """The weighted bounded-load rule: ``load < c x (total + work) x share``.

    >>> under_bound(0, 0, 1, 0.25, 1.25), under_bound(2, 3, 1, 0.25, 1.25), under_bound(1, 3, 1, 0.25, 1.25)
    (True, False, True)
    """
    return load < load_factor * (total + work) * share


def old_choose(
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

    Returns:
        ``(endpoint or None, reason)``; None only with reason ``no-memory``.
    """
    shares = pool.shares
    need = need_mib * (1.0 + margin)
    free = free_mib if (free_mib and need > 0) else None
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




def profile_for(load_factor: float, min_bound: float, pinned_load_factor: float, slack: float | None):
    """The default profile's steps with these parameters (the affinity slack added when set)."""
    steps: list[dict[str, Any]] = [
        {"plugin": "failed-endpoints"},
        {"plugin": "memory-admission"},
        {"plugin": "bounded-load", "params": {"load_factor": load_factor, "min_bound": min_bound,
                                              "pinned_load_factor": pinned_load_factor}},
    ]
    if slack is not None:
        steps.append({"plugin": "affinity-slack", "params": {"slack": slack}})
    steps += [{"plugin": "least-loaded"}, {"plugin": "ring-affinity"}]
    return build_profile(steps)


def new_choose(pool, position, pinned, loads, total, work, need_mib, free_mib, failed, load_factor, margin,
               request_id, min_bound, pinned_load_factor, slack):
    """The new default profile on the same inputs, the request built as ``ext_proc.picker.pick`` builds it
    (``request_id``: the ``x-request-id``; the old function got its hash, ``spin``)."""
    need = need_mib * (1.0 + margin)
    free = free_mib if (free_mib and need > 0) else None
    request = Request("c", pool, position, "session" if pinned else "prefix", pinned,
                      request_id if position is None else b"", work, need, loads, total, free, failed, None, None)
    choice = profile_for(load_factor, min_bound, pinned_load_factor, slack).choose(request)
    return choice.endpoint, choice.outcome


def random_case(rng: random.Random) -> dict[str, Any]:
    n = rng.choice([1, 2, 3, 4, 5, 8, 12]) if rng.random() < 0.85 else rng.randint(SCAN_MAX - 4, SCAN_MAX + 16)
    endpoints = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(n)]
    weights = {} if rng.random() < 0.4 else {e: rng.randint(1, 5) for e in endpoints}
    pool = ClusterEndpoints("c", tuple(endpoints), HashRing(endpoints, rng.choice([1, 4, 160])), 0, weights, {})
    integer = rng.random() < 0.5
    loads = {e: float(rng.randint(0, 6)) if integer else rng.uniform(0, 6) for e in endpoints if rng.random() < 0.8}
    total = sum(loads.values()) if rng.random() < 0.9 else rng.uniform(0, 30)
    position = None if rng.random() < 0.3 else rng.getrandbits(64)
    pinned = None
    if position is not None and rng.random() < 0.5:
        pinned = rng.choice(endpoints) if rng.random() < 0.9 else "9.9.9.9:1"
    need = 0.0 if rng.random() < 0.2 else rng.uniform(0, 3000)
    free = None if rng.random() < 0.3 else {e: rng.uniform(-500, 5000) for e in endpoints if rng.random() < 0.8}
    failed = frozenset(e for e in endpoints if rng.random() < (0.15 if rng.random() < 0.8 else 0.9))
    return dict(pool=pool, position=position, pinned=pinned, loads=loads, total=total,
                work=1.0 if rng.random() < 0.5 else rng.uniform(0.1, 3.0), need_mib=need, free_mib=free,
                failed=failed, load_factor=rng.choice([1.0, 1.25, rng.uniform(1.0, 3.0)]),
                margin=rng.choice([0.0, 0.2, rng.uniform(0, 0.5)]),
                request_id=b"" if rng.random() < 0.05 else b"%x" % rng.getrandbits(64),
                min_bound=rng.choice([0.0, 0.5, 2.0, rng.uniform(0, 4)]),
                pinned_load_factor=rng.choice([2.0, rng.uniform(1.0, 3.0)]),
                slack=None if rng.random() < 0.5 else rng.choice([0.0, 1.0, rng.uniform(0, 3)]))


@pytest.mark.parametrize("seed", range(8))
def test_the_default_profile_decides_as_the_old_scheduler(seed):
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for _ in range(2500):
        case = random_case(rng)
        spin = key_hash(case["request_id"]) if case["request_id"] else 0  # as the old pick() hashed it
        old = old_choose(case["pool"], case["position"], case["pinned"], case["loads"], case["total"], case["work"],
                         case["need_mib"], case["free_mib"], case["failed"], case["load_factor"], case["margin"],
                         spin, case["min_bound"], case["pinned_load_factor"], case["slack"])
        new = new_choose(**case)
        assert new == old, case
        outcomes[old[1]] = outcomes.get(old[1], 0) + 1
    # The cases reach every outcome, so the comparison covers every rule.
    assert set(outcomes) == {"affinity", "spilled", "memory", "repinned", "least-loaded", "no-memory"}, outcomes
