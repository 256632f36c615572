"""The weight engine: endpoints + stats (+ previous state) -> EDS weights, health and reasons.

A pure function. Per cluster: drain, then staleness (never the whole cluster: when every endpoint
is stale the last weights stay, case C05), then the filters; if the filters would exclude every
endpoint, none is excluded (an empty assignment is an outage). Eligible endpoints are scored, the
weighted scores combine into one score in [0, 1], and the weight is
``max(1, round(max_weight x capacity x score))`` (EDS weights must be >= 1, case C02), held at its
previous value when it moved by less than ``hysteresis`` (so weights don't flap).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from ..metrics.stats import EndpointStats
from . import stability
from .filters import FILTERS, is_stale
from .scorers import SCORERS
from .types import DRAINING, HEALTHY, UNHEALTHY, EndpointSpec, EndpointWeight, EngineParams, EngineState

#: Envoy rejects a locality whose weights sum past uint32 (case C02).
MAX_WEIGHT_SUM = 2**32 - 1
NEUTRAL_SCORE = 0.5
_NO_STATS = EndpointStats()


def sanitize(stats: EndpointStats) -> EndpointStats:
    """``stats`` with every non-finite value (NaN, ±Inf) replaced by ``None`` ("no data")."""
    bad = {f: None for f in EndpointStats.__slots__
           if (v := getattr(stats, f)) is not None and not math.isfinite(v)}
    return replace(stats, **bad) if bad else stats


def combine(scores: Mapping[str, float | None], weights: Mapping[str, float]) -> float:
    """Weighted mean of the scores that have data; :data:`NEUTRAL_SCORE` when none has. Result in [0, 1]."""
    num = den = 0.0
    for name, value in scores.items():
        w = weights.get(name, 0.0)
        if value is not None and w > 0:
            num += w * value
            den += w
    return num / den if den else NEUTRAL_SCORE


def compute_weights(
    specs: Sequence[EndpointSpec],
    stats: Mapping[str, EndpointStats],
    prev: EngineState,
    params: EngineParams,
) -> tuple[list[EndpointWeight], EngineState]:
    """Decide every endpoint's weight and health.

    Args:
        specs: the configured endpoints (any clusters, any order).
        stats: ``{instance: EndpointStats}``; a missing instance counts as "never seen".
        prev: the state returned by the previous round (``EngineState()`` at first).
        params: engine parameters.
    Returns:
        ``(weights, state)``: one :class:`EndpointWeight` per spec, in ``specs`` order, and the state
        for the next round. Every weight is >= 1 and each cluster's sum is <= 2**32 - 1.
    """
    by_cluster: dict[str, list[EndpointSpec]] = defaultdict(list)
    for spec in specs:
        by_cluster[spec.cluster].append(spec)
    out: dict[tuple[str, str], EndpointWeight] = {}
    for members in by_cluster.values():
        for ew in _cluster_weights(members, stats, prev, params):
            out[(ew.cluster, ew.address)] = ew
    ordered = [out[(s.cluster, s.address)] for s in specs]
    state = EngineState(MappingProxyType({(w.cluster, w.address): w.weight for w in ordered}))
    return ordered, state


def _cluster_weights(
    members: list[EndpointSpec], stats: Mapping[str, EndpointStats], prev: EngineState, params: EngineParams
) -> list[EndpointWeight]:
    cap = max(1, MAX_WEIGHT_SUM // len(members))
    seen = {s.address: sanitize(stats.get(s.instance, _NO_STATS)) for s in members}
    live = [s for s in members if not s.draining]
    all_stale = bool(live) and all(is_stale(seen[s.address], params) for s in live)

    excluded: dict[str, tuple[str, str]] = {}  # address -> (health, reason)
    for s in members:
        st = seen[s.address]
        if s.draining:
            excluded[s.address] = (DRAINING, "draining: no new requests")
        elif not all_stale and is_stale(st, params):
            age = "never seen" if st.sample_age_s is None else f"last sample {st.sample_age_s:.0f} s ago"
            excluded[s.address] = (UNHEALTHY, f"stale metrics ({age} > {params.stale_after_s:g} s)")
    filtered: dict[str, str] = {}
    if not all_stale:
        for s in live:
            if s.address in excluded:
                continue
            for name, fn in FILTERS.items():
                reason = fn(s, seen[s.address], params)
                if reason:
                    filtered[s.address] = f"{name}: {reason}"
                    break
    eligible = [s for s in live if s.address not in excluded and s.address not in filtered]
    kept_note = None
    if not eligible and filtered:
        eligible = [s for s in live if s.address in filtered]
        kept_note = "every endpoint was filtered out; none excluded (an empty cluster is an outage)"
    else:
        excluded.update({a: (UNHEALTHY, r) for a, r in filtered.items()})

    pool = [seen[s.address] for s in eligible]
    result = []
    for s in members:
        st = seen[s.address]
        key = (s.cluster, s.address)
        old = prev.weights.get(key)
        if s.address in excluded:
            health, reason = excluded[s.address]
            weight = min(old or 1, cap)
            result.append(EndpointWeight(s.cluster, s.address, weight, health, None, st, {}, (reason,)))
            continue
        if all_stale:
            weight = old if old is not None else max(1, round(params.max_weight * s.capacity * NEUTRAL_SCORE))
            reasons = ("metrics of every endpoint in the cluster are stale: last weights kept",)
            result.append(EndpointWeight(s.cluster, s.address, min(weight, cap), HEALTHY, None, st, {}, reasons))
            continue
        scores = {name: fn(s, st, pool) for name, fn in SCORERS.items()}
        score = combine(scores, params.scorer_weights)
        target = max(1, min(cap, round(params.max_weight * s.capacity * score)))
        weight = min(cap, stability.hold(old, target, params.hysteresis))
        reasons = [f"score {score:.2f} x capacity {s.capacity:g} ({s.gpu_class}) -> weight {target}"]
        if weight != target:
            reasons.append(f"held at {weight}: change under hysteresis {params.hysteresis:g}")
        if kept_note:
            reasons.append(kept_note)
        result.append(EndpointWeight(s.cluster, s.address, weight, HEALTHY, score, st, scores, tuple(reasons)))
    return result
