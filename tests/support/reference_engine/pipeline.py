"""The weight engine: endpoints + stats (+ previous state) -> EDS weights, health and reasons.

A pure function. Per cluster, in order:

1. **drain**: a draining endpoint is ``DRAINING`` at once; it is ``removed`` (left out of the
   ClusterLoadAssignment) once its fresh in-flight count is 0, or after ``drain_timeout_s`` (C11);
   once removed it stays removed (in-flight requests reappearing or stale metrics do not bring it
   back) until it is undrained or removed from and re-added to the config.
2. **staleness**: an endpoint whose newest sample is older than ``stale_after_s`` (or never seen) is
   ``UNHEALTHY`` (C04) — unless every live endpoint of the cluster is stale: then nothing is
   excluded, the last weights and every plugin's state stay (C05).
3. **filters** (registry order; the first reason wins), with health hysteresis: an exclusion takes
   effect once the endpoint was flagged ``health_rounds`` rounds in a row, and an excluded endpoint
   returns once it passed ``health_rounds`` rounds in a row (:func:`health_step`). If they would
   exclude every remaining endpoint, none is excluded (an empty assignment is an outage).
   Momentary saturation (free GPU memory, running requests) is not a filter: it is the picker's
   job per request; the slow loop only lowers the weight of an endpoint persistently short
   (factors ``gpu_memory`` and ``max_concurrency``).
4. **scorers** on the eligible endpoints; their weighted mean (weights from ``scorer_weights``, only
   scorers with data count; none with data: :data:`NEUTRAL_SCORE`) is the score in [0, 1].
5. **factors**: ``max_weight x score`` times each factor (capacity, slow start, balance).
6. **stability**: bounded change against the last weight (if the endpoint was eligible then),
   quantisation, hysteresis; weights at least 1 (EDS weights must be >= 1, case C02); then, if a
   cluster's sum passes uint32, the whole assignment is scaled down keeping its ratios (:func:`fit_uint32`).

Every verdict is kept on the :class:`EndpointWeight` for the admin API and the change log.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from tests.support.reference_engine import stability
from tests.support.reference_engine.plugin import ClusterRound, Member, PluginSet
from xds_server.engine.types import (
    DRAINING,
    HEALTHY,
    UNHEALTHY,
    EndpointSpec,
    EndpointWeight,
    EngineParams,
    EngineState,
)
from xds_server.metrics.stats import EndpointStats

#: Envoy rejects a locality whose weights sum past uint32 (case C02).
MAX_WEIGHT_SUM = 2**32 - 1
NEUTRAL_SCORE = 0.5
_INF = (math.inf, -math.inf)
#: State key of the drain stage: per draining endpoint ``(started at (s), removal reason or None)``.
#: A removal is remembered until the endpoint is undrained or leaves the config.
DRAIN = "drain"
#: State key of the health hysteresis: ``(flagged rounds in a row, passed rounds in a row, excluded)``.
HEALTH = "health"
_NO_STATS = EndpointStats()
Key = tuple[str, str]


def combine(scores: Mapping[str, float | None], weights: Mapping[str, float]) -> float:
    """Weighted mean of the scores that have data; :data:`NEUTRAL_SCORE` when none has. Result in [0, 1]."""
    num = den = 0.0
    for name, value in scores.items():
        w = weights.get(name, 0.0)
        if value is not None and w > 0:
            num += w * value
            den += w
    return min(1.0, max(0.0, num / den)) if den else NEUTRAL_SCORE


def is_stale(stats: EndpointStats, params: EngineParams) -> bool:
    """True when the newest sample is older than ``stale_after_s`` or was never seen (case C04)."""
    return stats.sample_age_s is None or stats.sample_age_s > params.stale_after_s


def plugin_params(name: str, params: EngineParams, plugins: PluginSet) -> Any:
    """The parameters of plugin ``name``: from ``params.plugin_params`` or the plugin's defaults.

    Raises:
        KeyError: ``name`` is not in ``plugins``.
    """
    given = params.plugin_params.get(name)
    return given if given is not None else plugins.params_model(name)()


def compute_weights(
    specs: Sequence[EndpointSpec],
    stats: Mapping[str, EndpointStats],
    prev: EngineState,
    params: EngineParams,
    now: float = 0.0,
    *,
    plugins: PluginSet,
) -> tuple[list[EndpointWeight], EngineState]:
    """Decide every endpoint's weight and health.

    Args:
        specs: the configured endpoints (any clusters, any order).
        stats: ``{instance: EndpointStats}``; a missing instance counts as "never seen"; NaN/Inf
            values count as no data.
        prev: the state returned by the previous round (``EngineState()`` at first).
        params: engine parameters.
        now: the round's time in seconds, on the clock used for every round (ejections, slow
            start and drain timeouts are measured on it).
        plugins: the filters, scorers and factors to run (``tests.support.reference_engine.builtin.BUILTIN``).
    Returns:
        ``(weights, state)``: one :class:`EndpointWeight` per spec, in ``specs`` order, and the state
        for the next round. Every weight is >= 1 and each cluster's sum is <= 2**32 - 1.
    """
    by_cluster: dict[str, list[EndpointSpec]] = defaultdict(list)
    for spec in specs:
        by_cluster[spec.cluster].append(spec)
    out: dict[Key, EndpointWeight] = {}
    eligible: set[Key] = set()
    new_state: dict[str, Mapping[str, Any]] = {}
    scorer_weights = plugins.scorer_weights(params.scorer_weights)
    decided: dict[Key, int] = {}  # the weights before fit_uint32: what the next round compares with
    for cluster, members in by_cluster.items():
        weights, ok, cluster_state = _cluster(cluster, members, stats, prev, prev.plugins.get(cluster, {}), params,
                                              now, plugins, scorer_weights)
        for ew in weights:
            decided[(ew.cluster, ew.address)] = ew.weight
        for ew in fit_uint32(weights):
            out[(ew.cluster, ew.address)] = ew
        eligible |= {(cluster, a) for a in ok}
        kept = {name: MappingProxyType(entries) for name, entries in cluster_state.items() if entries}
        if kept:
            new_state[cluster] = MappingProxyType(kept)
    ordered = [out[(s.cluster, s.address)] for s in specs]
    state = EngineState(
        MappingProxyType({(s.cluster, s.address): decided[(s.cluster, s.address)] for s in specs}),
        frozenset(eligible),
        MappingProxyType(new_state),
    )
    return ordered, state


def health_step(record: tuple[int, int, bool], flagged: bool, rounds: int) -> tuple[int, int, bool]:
    """One round of the filters' health hysteresis for one endpoint (pure).

    ``record``: ``(flagged rounds in a row, passed rounds in a row, excluded)`` after the last round
    (``(0, 0, False)`` for a new endpoint); ``flagged``: a filter flagged it this round; ``rounds``:
    ``health_rounds``. Returns the new record; its last item says whether it is excluded now.

    >>> health_step((0, 0, False), True, 2), health_step((1, 0, False), True, 2)
    ((1, 0, False), (2, 0, True))
    >>> health_step((2, 0, True), False, 2), health_step((0, 1, True), False, 2)
    ((0, 1, True), (0, 2, False))
    """
    flags, passes, excluded = record
    if flagged:
        flags, passes = flags + 1, 0
        return flags, passes, excluded or flags >= rounds
    flags, passes = 0, passes + 1
    return flags, passes, excluded and passes < rounds


def fit_uint32(weights: Sequence[EndpointWeight], limit: int = MAX_WEIGHT_SUM) -> list[EndpointWeight]:
    """One cluster's weights scaled as a whole so their sum fits ``limit`` (uint32: Envoy rejects a
    locality whose weights sum past it, case C02), keeping their ratios; each stays >= 1.

    Unchanged when the sum already fits. Otherwise every weight becomes ``max(1, floor(w x f))`` with
    ``f = (limit - n) / sum``: the floor loses less than 1 per endpoint and the ``max(1, .)`` adds at
    most 1, so the sum is <= ``limit``. Each scaled endpoint gets a reason saying so.

    >>> [w.weight for w in fit_uint32([_ew(30), _ew(10)], limit=12)]
    [7, 2]
    """
    total = sum(w.weight for w in weights)
    if total <= limit:
        return list(weights)
    factor = (limit - len(weights)) / total
    note = f"scaled x{factor:.3g} with the whole cluster: its weights summed to {total}, past uint32"
    return [replace(w, weight=max(1, math.floor(w.weight * factor)), reasons=(*w.reasons, note)) for w in weights]


def _ew(weight: int) -> EndpointWeight:  # for the doctest
    return EndpointWeight("c", f"10.0.0.{weight}:80", weight, HEALTHY, None, _NO_STATS, {}, ())


def _drain(s: EndpointSpec, st: EndpointStats, started: float, params: EngineParams, now: float
           ) -> tuple[bool, str]:
    """``(removed, reason)`` for a draining endpoint."""
    waited = max(0.0, now - started)
    if waited >= params.drain_timeout_s:
        return True, f"draining: removed after the {params.drain_timeout_s:g} s drain timeout"
    if not is_stale(st, params):
        idle = (st.in_flight <= 0 if st.in_flight is not None
                else st.running is not None and st.running <= 0 and (st.queue or 0.0) <= 0)
        if idle:
            return True, f"draining: no request in flight after {waited:.0f} s; removed"
    flight = "unknown" if st.in_flight is None else f"{st.in_flight:g}"
    return False, f"draining: no new requests; {flight} in flight ({waited:.0f} of {params.drain_timeout_s:g} s)"


def _shared(table: dict[tuple, Mapping[str, str]], values: dict[str, str]) -> Mapping[str, str]:
    """A read-only view of ``values``: the same object for every equal ``values`` seen in ``table``."""
    key = tuple(values.items())
    view = table.get(key)
    if view is None:
        view = table[key] = MappingProxyType(values)
    return view


def _cluster(
    cluster: str, members: list[EndpointSpec], stats: Mapping[str, EndpointStats], prev: EngineState,
    prev_plugins: Mapping[str, Mapping[str, Any]], params: EngineParams, now: float, plugins: PluginSet,
    scorer_weights: Mapping[str, float],
) -> tuple[list[EndpointWeight], set[str], dict[str, dict[str, Any]]]:
    cap = MAX_WEIGHT_SUM  # one weight; the cluster's sum is fitted at the end (fit_uint32)
    seen = {s.address: stats.get(s.instance, _NO_STATS).sanitized() for s in members}
    live = [s for s in members if not s.draining]
    first_round = not any((cluster, s.address) in prev.weights for s in members)
    addresses = {s.address for s in members}
    state: dict[str, dict[str, Any]] = {  # endpoints no longer configured are forgotten (C-level when none is)
        name: dict(v) if v.keys() <= addresses else {a: x for a, x in v.items() if a in addresses}
        for name, v in prev_plugins.items()}

    def old_weight(s: EndpointSpec) -> int | None:
        return prev.weights.get((cluster, s.address))

    result: dict[str, EndpointWeight] = {}
    drains = state.setdefault(DRAIN, {})
    for s in members:
        if not s.draining:
            drains.pop(s.address, None)
            continue
        started, gone = drains.get(s.address, (now, None))
        if gone is not None:  # removed once: stays removed until undrained or re-added (not recomputed)
            removed, reason = True, gone
        else:
            removed, reason = _drain(s, seen[s.address], started, params, now)
        drains[s.address] = (started, reason if removed else None)
        result[s.address] = EndpointWeight(cluster, s.address, min(old_weight(s) or 1, cap), DRAINING, None,
                                           seen[s.address], {}, (reason,), removed=removed)

    all_stale = bool(live) and all(is_stale(seen[s.address], params) for s in live)
    if all_stale:
        ok = {s.address for s in live if (cluster, s.address) in prev.eligible}
        for s in live:
            old = old_weight(s)
            weight = old if old is not None else max(1, round(params.max_weight * s.capacity * NEUTRAL_SCORE))
            reasons = ("metrics of every endpoint in the cluster are stale: last weights kept",)
            result[s.address] = EndpointWeight(cluster, s.address, max(1, min(weight, cap)), HEALTHY, None,
                                               seen[s.address], {}, reasons)
        return [result[s.address] for s in members], ok, state

    verdicts: dict[str, dict[str, str]] = {s.address: {} for s in live}
    excluded: dict[str, str] = {}
    for s in live:
        st = seen[s.address]
        if is_stale(st, params):
            age = "never seen" if st.sample_age_s is None else f"last sample {st.sample_age_s:.0f} s ago"
            excluded[s.address] = f"stale metrics ({age} > {params.stale_after_s:g} s)"

    candidates = [Member(s, seen[s.address], s.address) for s in live if s.address not in excluded]
    filtered: dict[str, str] = {}
    for name, f in plugins.filters.items():
        if name in params.disabled:
            continue
        rnd = ClusterRound(cluster, now, tuple(candidates), len(live), first_round, params)
        reasons, state[name] = f.run(rnd, plugin_params(name, params, plugins), state.get(name, {}))
        for m in candidates:
            verdicts[m.address][name] = reasons.get(m.address) or "pass"
        for address, reason in reasons.items():
            if address in verdicts and address not in filtered and address not in excluded:
                filtered[address] = f"{name}: {reason}"
        candidates = [m for m in candidates if m.address not in filtered]
    for s in live:
        for name in plugins.filters:
            verdicts[s.address].setdefault(name, "off" if name in params.disabled else "not run")

    # Health hysteresis: one round's verdict changes nothing (saturation and one odd window are not health).
    health_prev = state.get(HEALTH, {})
    health: dict[str, tuple[int, int, bool]] = {}
    held: dict[str, str] = {}
    for s in live:
        a = s.address
        if a in excluded:  # stale: time-based already; the hysteresis record starts again after it
            continue
        rec = health_step(health_prev.get(a, (0, 0, False)), a in filtered, params.health_rounds)
        if rec != (0, 0, False):
            health[a] = rec
        if a in filtered and not rec[2]:
            note = f"{filtered.pop(a)} (flagged {rec[0]} of {params.health_rounds} rounds: not excluded yet)"
            held[a] = note
        elif a not in filtered and rec[2]:
            filtered[a] = f"recovering: passed {rec[1]} of {params.health_rounds} rounds since its exclusion"
    state[HEALTH] = health
    if held or any(a in filtered for a in (m.address for m in candidates)):
        candidates = [Member(s, seen[s.address]) for s in live
                      if s.address not in excluded and s.address not in filtered]

    kept_note = None
    if not candidates and filtered:
        candidates = [Member(s, seen[s.address], s.address) for s in live if s.address in filtered]
        kept_note = "every endpoint was filtered out; none excluded (an empty cluster is an outage)"
    else:
        excluded.update(filtered)

    rnd = ClusterRound(cluster, now, tuple(candidates), len(live), first_round, params)
    runs: list[tuple[str, float, Mapping[str, float | None]]] = []
    for name, sc in plugins.scorers.items():
        w = scorer_weights.get(name, 0.0)
        if w <= 0:  # off: not run (its score could not count anyway)
            continue
        values, state[name] = sc.run(rnd, plugin_params(name, params, plugins), state.get(name, {}))
        runs.append((name, w, values))
    # The weighted mean of combine(), accumulated scorer by scorer (in run order), one endpoint at a time.
    scores: dict[str, dict[str, float | None]] = {}
    combined: dict[str, float] = {}
    for m in candidates:
        a = m.address
        per: dict[str, float | None] = {}
        num = den = 0.0
        for name, w, values in runs:
            v = values.get(a)
            if v is None or v != v or v in _INF:  # no data, NaN, +-Inf
                per[name] = None
                continue
            v = v if 0.0 <= v <= 1.0 else (0.0 if v < 0.0 else 1.0)
            per[name] = v
            num += w * v
            den += w
        scores[a] = per
        combined[a] = min(1.0, max(0.0, num / den)) if den else NEUTRAL_SCORE
    raw = {a: params.max_weight * c for a, c in combined.items()}
    factors: dict[str, dict[str, float]] = {m.address: {} for m in candidates}
    for name, fa in plugins.factors.items():
        if name in params.disabled:
            continue
        mults, state[name] = fa.run(rnd, plugin_params(name, params, plugins), state.get(name, {}),
                                    MappingProxyType(raw))
        for a in raw:
            m = mults.get(a, 1.0)
            m = m if math.isfinite(m) and m > 0 else 1.0
            factors[a][name] = m
            raw[a] *= m

    step = max(1, round(params.quantum * params.max_weight))
    max_weight, growth = f"{params.max_weight:g}", f"{1 + (params.max_change or 0):g}"
    # Most endpoints share their filter verdicts and factor multipliers ("pass" everywhere, x 1):
    # one read-only mapping per distinct content, not one per endpoint (memory, allocations).
    shared_verdicts: dict[tuple, Mapping[str, str]] = {}
    shared_factors: dict[tuple, tuple[Mapping[str, float], str]] = {}
    for m in candidates:
        a, s = m.address, m.spec
        key = (cluster, a)
        was = old_weight(s) if key in prev.eligible else None
        target = min(cap, stability.quantize(raw[a], step))
        bounded = min(cap, stability.quantize(stability.bound(was, raw[a], params.max_change), step))
        weight = max(1, min(cap, stability.hold(was, bounded, params.hysteresis)))
        fkey = tuple(factors[a].items())
        hit = shared_factors.get(fkey)
        if hit is None:
            parts = "".join(f" x {n} {v:.3g}" for n, v in fkey if v != 1.0)
            hit = shared_factors[fkey] = (MappingProxyType(factors[a]), parts)
        factor_map, parts = hit
        reasons = [f"score {combined[a]:.2f} x max_weight {max_weight}{parts} -> {target}"]
        if bounded != target:
            reasons.append(f"bounded to {bounded}: at most x{growth} per round")
        if weight != bounded:
            reasons.append(f"held at {weight}: change under hysteresis {params.hysteresis:g}")
        if kept_note:
            reasons.append(kept_note)
        if a in held:
            reasons.append(held[a])
        result[a] = EndpointWeight(cluster, a, weight, HEALTHY, combined[a], m.stats, MappingProxyType(scores[a]),
                                   tuple(reasons), _shared(shared_verdicts, verdicts[a]), factor_map, target)
    for s in live:
        if s.address in excluded:
            result[s.address] = EndpointWeight(
                cluster, s.address, max(1, min(old_weight(s) or 1, cap)), UNHEALTHY, None, seen[s.address], {},
                (excluded[s.address],), _shared(shared_verdicts, verdicts[s.address]))
    return [result[s.address] for s in members], {m.address for m in candidates}, state
