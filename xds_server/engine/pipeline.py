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
from types import MappingProxyType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from xds_server.engine import stability
from xds_server.engine.plugin import Array, ClusterRound, Columns, PluginSet
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


def combine(scores: Mapping[str, ArrayLike], weights: Mapping[str, float]) -> np.ndarray:
    """Weighted mean of the scores that have data (element-wise: each value an array, one per endpoint,
    or a scalar; NaN or None = no data), accumulated scorer by scorer in ``scores`` order;
    :data:`NEUTRAL_SCORE` where none has. Result in [0, 1]."""
    num = den = np.float64(0.0)
    for name, value in scores.items():
        w = weights.get(name, 0.0)
        if w > 0:
            v = np.asarray(value, dtype=float)
            known = ~np.isnan(v)
            num = num + np.where(known, w * v, 0.0)
            den = den + np.where(known, w, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 where no scorer has data
        return np.where(den > 0, np.clip(num / den, 0.0, 1.0), NEUTRAL_SCORE)


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
        plugins: the filters, scorers and factors to run (``xds_server.engine.builtin.BUILTIN``).
    Returns:
        ``(weights, state)``: one :class:`EndpointWeight` per spec, in ``specs`` order, and the state
        for the next round. Every weight is >= 1 and each cluster's sum is <= 2**32 - 1.
    """
    by_cluster: dict[str, list[int]] = defaultdict(list)  # positions in specs
    for i, spec in enumerate(specs):
        by_cluster[spec.cluster].append(i)
    ordered: list[EndpointWeight] = [None] * len(specs)  # type: ignore[list-item]
    decided: dict[Key, int] = {}  # the weights before fit_uint32: what the next round compares with
    eligible: list[Key] = []
    new_state: dict[str, Mapping[str, Any]] = {}
    addresses: dict[str, tuple[str, ...]] = {}
    scorer_weights = plugins.scorer_weights(params.scorer_weights)
    for cluster, at in by_cluster.items():
        members = [specs[i] for i in at]
        addresses[cluster] = tuple(s.address for s in members)
        with np.errstate(all="ignore"):  # inf and NaN are data here (no data, or clamped), not errors
            weights, ok, cluster_state = _cluster(cluster, members, addresses[cluster], stats, prev,
                                                  prev.plugins.get(cluster, {}), params, now, plugins, scorer_weights)
        keys = [(cluster, s.address) for s in members]  # one tuple per endpoint, shared by both tables
        decided.update(zip(keys, [ew.weight for ew in weights], strict=True))
        for i, ew in zip(at, fit_uint32(weights), strict=True):
            ordered[i] = ew
        eligible.extend(k for k in keys if k[1] in ok)
        # Each plugin's state as the plugin returned it, read-only by contract (State is a Mapping): a
        # MappingProxyType around it would make every copy a plugin makes of it a generic walk (19-35 ms
        # for 60 000 entries, against 1-3 ms for a dict's copy).
        kept = {name: entries for name, entries in cluster_state.items() if entries}
        if kept:
            new_state[cluster] = MappingProxyType(kept)
    return ordered, EngineState(MappingProxyType(decided), frozenset(eligible), MappingProxyType(new_state),
                                MappingProxyType(addresses))


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
    return [w._replace(weight=max(1, math.floor(w.weight * factor)), reasons=(*w.reasons, note)) for w in weights]


def _ew(weight: int) -> EndpointWeight:  # for the doctest
    return EndpointWeight("c", f"10.0.0.{weight}:80", weight, HEALTHY, None, _NO_STATS, {}, ())


def _drain(s: EndpointSpec, st: EndpointStats, started: float, params: EngineParams, now: float
           ) -> tuple[bool, str]:
    """``(removed, reason)`` for a draining endpoint: removed at the drain timeout, or once a sample
    taken after the drain began (``now - sample_age_s > started``) shows nothing in flight. A sample
    from before cannot tell: the requests Envoy sent until the drain reached it are not in it (a
    user trial saw an endpoint removed 0.2 s into its drain with 14 requests running)."""
    waited = max(0.0, now - started)
    if waited >= params.drain_timeout_s:
        return True, f"draining: removed after the {params.drain_timeout_s:g} s drain timeout"
    if not is_stale(st, params) and now - (st.sample_age_s or 0.0) > started:
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
    cluster: str, members: list[EndpointSpec], addresses: tuple[str, ...], stats: Mapping[str, EndpointStats],
    prev: EngineState,
    prev_plugins: Mapping[str, Mapping[str, Any]], params: EngineParams, now: float, plugins: PluginSet,
    scorer_weights: Mapping[str, float],
) -> tuple[list[EndpointWeight], set[str], dict[str, dict[str, Any]]]:
    """One cluster, array-wise: each step is a few numpy operations over the cluster's members; Python
    loops walk only the endpoints some rule singles out (draining, stale, filtered, ejected, ramping)
    and build the per-endpoint verdicts at the end."""
    cap = MAX_WEIGHT_SUM  # one weight; the cluster's sum is fitted at the end (fit_uint32)
    n = len(members)
    raw_stats = [stats.get(s.instance, _NO_STATS) for s in members]
    columns = Columns.of(members, raw_stats)
    seen = raw_stats
    for i in np.flatnonzero(columns.dirty).tolist():
        seen[i] = raw_stats[i].sanitized()
    draining = np.fromiter((s.draining for s in members), dtype=bool, count=n)
    live = np.flatnonzero(~draining)
    first_round = not any((cluster, a) in prev.weights for a in addresses)
    # Endpoints no longer configured are forgotten. The states are read-only mappings (plugins return
    # new ones), passed on as they are when no address can be missing: the same addresses as last
    # round (compared in ~0.4 ms at 60 000; checking every key of every state took ~10 ms each, in one
    # C call holding the GIL).
    if prev.addresses.get(cluster) == addresses:
        state: dict[str, Mapping[str, Any]] = dict(prev_plugins)
    else:
        configured = set(addresses)
        state = {name: v if v.keys() <= configured else {a: x for a, x in v.items() if a in configured}
                 for name, v in prev_plugins.items()}
    base = ClusterRound(cluster, now, addresses, tuple(members), columns, len(live), first_round, params)

    def old_weight(i: int) -> int | None:
        return prev.weights.get((cluster, addresses[i]))

    result: list[EndpointWeight | None] = [None] * n
    drains = state[DRAIN] = dict(state.get(DRAIN, {}))  # changed below: a copy (the previous state is read-only)
    draining_at = np.flatnonzero(draining).tolist()
    leaving = {addresses[i] for i in draining_at}
    for a in [a for a in drains if a not in leaving]:
        del drains[a]
    for i in draining_at:
        a, s = addresses[i], members[i]
        started, gone = drains.get(a, (now, None))
        if gone is not None:  # removed once: stays removed until undrained or re-added (not recomputed)
            removed, reason = True, gone
        else:
            removed, reason = _drain(s, seen[i], started, params, now)
        drains[a] = (started, reason if removed else None)
        result[i] = EndpointWeight(cluster, a, min(old_weight(i) or 1, cap), DRAINING, None, seen[i], {}, (reason,),
                                   removed=removed)

    age = columns.stats["sample_age_s"]
    stale = np.isnan(age) | (age > params.stale_after_s)
    if len(live) and stale[live].all():
        ok = {addresses[i] for i in live.tolist() if (cluster, addresses[i]) in prev.eligible}
        for i in live.tolist():
            old = old_weight(i)
            weight = old if old is not None else max(1, round(params.max_weight * members[i].capacity * NEUTRAL_SCORE))
            reasons = ("metrics of every endpoint in the cluster are stale: last weights kept",)
            result[i] = EndpointWeight(cluster, addresses[i], max(1, min(weight, cap)), HEALTHY, None, seen[i], {},
                                       reasons)
        return result, ok, state  # type: ignore[return-value]

    excluded: dict[str, str] = {}
    for i in live[stale[live]].tolist():
        st = seen[i]
        age_note = "never seen" if st.sample_age_s is None else f"last sample {st.sample_age_s:.0f} s ago"
        excluded[addresses[i]] = f"stale metrics ({age_note} > {params.stale_after_s:g} s)"
    stale_out = set(excluded)
    pool = live[~stale[live]]  # live and fresh: what the filters judge

    def round_of(index: Array) -> ClusterRound:
        return base if len(index) == n else base.take(index)

    # Filters, in order; each sees the endpoints no earlier filter flagged.
    candidates = pool
    filtered: dict[str, str] = {}
    judged: dict[str, list[tuple[str, str]]] = {}  # the verdicts of flagged endpoints, in run order
    ran: list[str] = []
    for name, f in plugins.filters.items():
        if name in params.disabled:
            continue
        rnd = round_of(candidates)
        reasons, state[name] = f.run(rnd, plugin_params(name, params, plugins), state.get(name, {}))
        ran.append(name)
        inside = rnd.index() if reasons else {}
        for address, reason in reasons.items():
            if address in inside and address not in filtered:
                filtered[address] = f"{name}: {reason}"
                judged[address] = [*((r, "pass") for r in ran[:-1]), (name, reason or "pass")]
        if reasons:
            gone = np.fromiter((a in filtered for a in rnd.addresses), dtype=bool, count=len(rnd.addresses))
            candidates = candidates[~gone]

    # Per filter: its reason or "pass" where it ran on the endpoint, else "off" or "not run". Most
    # endpoints share their filter verdicts and factor multipliers ("pass" everywhere, x 1): one
    # read-only mapping per distinct content, not one per endpoint (memory, allocations).
    shared_verdicts: dict[tuple, Mapping[str, str]] = {}
    shared_factors: dict[tuple, tuple[Mapping[str, float], str]] = {}
    # Reasons too: 60 000 endpoints had 510 distinct reason tuples of 109 distinct strings (8 MB a round).
    shared_reasons: dict[tuple[str, ...], tuple[str, ...]] = {}

    def verdict_map(given: list[tuple[str, str]]) -> Mapping[str, str]:
        out = dict(given)
        for name in plugins.filters:
            out.setdefault(name, "off" if name in params.disabled else "not run")
        return _shared(shared_verdicts, out)

    passed, unjudged = verdict_map([(r, "pass") for r in ran]), verdict_map([])

    def verdicts(address: str) -> Mapping[str, str]:
        given = judged.get(address)
        return verdict_map(given) if given is not None else unjudged if address in stale_out else passed

    # Health hysteresis: one round's verdict changes nothing (saturation and one odd window are not health).
    # Only flagged or excluded endpoints keep a record: a record of passes alone acts as no record.
    health_prev = state.get(HEALTH, {})
    health: dict[str, tuple[int, int, bool]] = {}
    held: dict[str, str] = {}
    index = base.index()
    fresh = np.zeros(n, dtype=bool)
    fresh[pool] = True
    for a in sorted({*health_prev, *filtered}, key=index.__getitem__):
        if not fresh[index[a]]:  # stale or draining: the hysteresis record starts again after it
            continue
        rec = health_step(health_prev.get(a, (0, 0, False)), a in filtered, params.health_rounds)
        if rec[0] or rec[2]:
            health[a] = rec
        if a in filtered and not rec[2]:
            note = f"{filtered.pop(a)} (flagged {rec[0]} of {params.health_rounds} rounds: not excluded yet)"
            held[a] = note
        elif a not in filtered and rec[2]:
            filtered[a] = f"recovering: passed {rec[1]} of {params.health_rounds} rounds since its exclusion"
    state[HEALTH] = health
    out_now = np.fromiter((a in filtered for a in (addresses[i] for i in pool.tolist())), dtype=bool,
                          count=len(pool)) if filtered else np.zeros(len(pool), dtype=bool)
    eligible = pool[~out_now]

    kept_note = None
    if not len(eligible) and filtered:
        eligible = pool[out_now]
        kept_note = "every endpoint was filtered out; none excluded (an empty cluster is an outage)"
    else:
        excluded.update(filtered)

    rnd = round_of(eligible)
    m = len(eligible)
    scores: dict[str, Array] = {}
    for name, sc in plugins.scorers.items():
        if scorer_weights.get(name, 0.0) <= 0:  # off: not run (its score could not count anyway)
            continue
        values, state[name] = sc.run(rnd, plugin_params(name, params, plugins), state.get(name, {}))
        values = np.asarray(values, dtype=float)
        scores[name] = np.where(np.isfinite(values), np.clip(values, 0.0, 1.0), np.nan)  # NaN, +-Inf: no data
    combined = np.broadcast_to(combine(scores, scorer_weights), (m,))
    score_names = list(scores)
    score_lists = [[None if x != x else x for x in v.tolist()] for v in scores.values()]
    raw = params.max_weight * combined
    factor_names: list[str] = []
    factor_lists: list[list[float]] = []
    for name, fa in plugins.factors.items():
        if name in params.disabled:
            continue
        so_far = raw.copy()
        so_far.flags.writeable = False
        mults, state[name] = fa.run(rnd, plugin_params(name, params, plugins), state.get(name, {}), so_far)
        mults = np.asarray(mults, dtype=float)
        mults = np.where(np.isfinite(mults) & (mults > 0), mults, 1.0)
        raw = raw * mults
        factor_names.append(name)
        factor_lists.append(mults.tolist())

    # Stability, element-wise: bounded change against the last weight (if eligible then), quantised, held.
    step = max(1, round(params.quantum * params.max_weight))
    was = np.array([prev.weights.get((cluster, a), np.nan) if (cluster, a) in prev.eligible else np.nan
                    for a in rnd.addresses], dtype=float)
    target = np.minimum(cap, stability.quantize(raw, step))
    bounded = np.minimum(cap, stability.quantize(stability.bound(was, raw, params.max_change), step))
    weights = np.maximum(1.0, np.minimum(cap, stability.hold(was, bounded, params.hysteresis))).astype(np.int64)

    max_weight, growth = f"{params.max_weight:g}", f"{1 + (params.max_change or 0):g}"
    extra = [kept_note] if kept_note else []
    hysteresis = f"{params.hysteresis:g}"
    rows = zip(eligible.tolist(), rnd.addresses, combined.tolist(), target.astype(np.int64).tolist(),
               bounded.astype(np.int64).tolist(), weights.tolist(), zip(*score_lists, strict=True) if score_lists else
               ((),) * m, zip(*factor_lists, strict=True) if factor_lists else ((),) * m, strict=True)
    for i, a, score, tgt, bnd, weight, row, mults in rows:
        hit = shared_factors.get(mults)
        if hit is None:
            fkey = tuple(zip(factor_names, mults, strict=True))
            parts = "".join(f" x {fn} {fv:.3g}" for fn, fv in fkey if fv != 1.0)
            hit = shared_factors[mults] = (MappingProxyType(dict(fkey)), parts)
        factor_map, parts = hit
        reasons = [f"score {score:.2f} x max_weight {max_weight}{parts} -> {tgt}"]
        if bnd != tgt:
            reasons.append(f"bounded to {bnd}: at most x{growth} per round")
        if weight != bnd:
            reasons.append(f"held at {weight}: change under hysteresis {hysteresis}")
        if extra:
            reasons.extend(extra)
        if held and a in held:
            reasons.append(held[a])
        why = tuple(reasons)
        result[i] = EndpointWeight(cluster, a, weight, HEALTHY, score, seen[i],
                                   MappingProxyType(dict(zip(score_names, row, strict=True))),
                                   shared_reasons.setdefault(why, why),
                                   verdicts(a) if judged else passed, factor_map, tgt)
    for i in live.tolist():
        a = addresses[i]
        if a in excluded:
            result[i] = EndpointWeight(cluster, a, max(1, min(old_weight(i) or 1, cap)), UNHEALTHY, None, seen[i], {},
                                       (excluded[a],), verdicts(a))
    return result, set(rnd.addresses), state  # type: ignore[return-value]

