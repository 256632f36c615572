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

import numpy as np
from numpy.typing import ArrayLike

from xds_server.engine import stability
from xds_server.engine.plugin import Array, ClusterRound, Columns, PluginSet
from xds_server.engine.types import (
    DRAINING,
    HEALTHY,
    UNHEALTHY,
    ClusterMemory,
    EndpointSpec,
    EngineParams,
    EngineState,
)
from xds_server.engine.verdicts import ClusterBuilder, ClusterVerdicts, Verdicts, group_rows
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
) -> tuple[Verdicts, EngineState]:
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
        ``(weights, state)``: one :class:`EndpointWeight` per spec, in ``specs`` order (read from
        columns: one :class:`~xds_server.engine.verdicts.ClusterVerdicts` per cluster), and the state
        for the next round. Every weight is >= 1 and each cluster's sum is <= 2**32 - 1.
    """
    by_cluster: dict[str, list[int]] = defaultdict(list)  # positions in specs
    for i, spec in enumerate(specs):
        by_cluster[spec.cluster].append(i)
    parts: list[ClusterVerdicts] = []
    memory: dict[str, ClusterMemory] = {}
    new_state: dict[str, Mapping[str, Any]] = {}
    scorer_weights = plugins.scorer_weights(params.scorer_weights)
    for cluster, at in by_cluster.items():
        members = [specs[i] for i in at]
        addresses = tuple(s.address for s in members)
        with np.errstate(all="ignore"):  # inf and NaN are data here (no data, or clamped), not errors
            verdicts, ok, cluster_state = _cluster(cluster, members, addresses, stats, prev.clusters.get(cluster),
                                                   prev.plugins.get(cluster, {}), params, now, plugins, scorer_weights)
        memory[cluster] = ClusterMemory(addresses, verdicts.weight, ok)  # before the fit: what the next round compares
        weight, note = fit_uint32(verdicts.weight)
        if note is not None:
            verdicts = replace(verdicts, weight=weight, reason_table=tuple((*r, note) for r in verdicts.reason_table))
        parts.append(verdicts)
        # Each plugin's state as the plugin returned it, read-only by contract (State is a Mapping): a
        # MappingProxyType around it would make every copy a plugin makes of it a generic walk (19-35 ms
        # for 60 000 entries, against 1-3 ms for a dict's copy).
        kept = {name: entries for name, entries in cluster_state.items() if entries}
        if kept:
            new_state[cluster] = MappingProxyType(kept)
    in_order = [i for at in by_cluster.values() for i in at] == list(range(len(specs)))
    return (Verdicts(parts, None if in_order else [np.array(at, dtype=np.int64) for at in by_cluster.values()]),
            EngineState(MappingProxyType(memory), MappingProxyType(new_state)))


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


def fit_uint32(weights: ArrayLike, limit: int = MAX_WEIGHT_SUM) -> tuple[np.ndarray, str | None]:
    """One cluster's weights (integers >= 1) scaled as a whole so their sum fits ``limit`` (uint32:
    Envoy rejects a locality whose weights sum past it, case C02), keeping their ratios; each stays >= 1.

    Returns ``(weights as int64, note)``: unchanged and None when the sum already fits. Otherwise every
    weight becomes ``max(1, floor(w x f))`` with ``f = (limit - n) / sum`` (the floor loses less than 1
    per endpoint and the ``max(1, .)`` adds at most 1, so the sum is <= ``limit``), and ``note`` is the
    reason each scaled endpoint gets.

    >>> w, note = fit_uint32([30, 10], limit=12)
    >>> w.tolist(), note
    ([7, 2], 'scaled x0.25 with the whole cluster: its weights summed to 40, past uint32')
    """
    weights = np.asarray(weights, dtype=np.int64)
    total = int(weights.sum())
    if total <= limit:
        return weights, None
    factor = (limit - len(weights)) / total
    note = f"scaled x{factor:.3g} with the whole cluster: its weights summed to {total}, past uint32"
    return np.maximum(1.0, np.floor(weights.astype(float) * factor)).astype(np.int64), note


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


def hundredths(x: np.ndarray) -> np.ndarray:
    """``x`` (finite floats) as whole hundredths, rounded as ``f"{v:.2f}"`` rounds each (int64).

    >>> hundredths(np.array([0.125, 0.135, 0.5349, 1.0])).tolist()
    [12, 14, 53, 100]
    """
    scaled = x * 100.0
    out = np.rint(scaled).astype(np.int64)
    # Near a half the product's rounding could decide: those few are rounded by Python's formatting.
    for i in np.flatnonzero(np.abs(scaled - np.floor(scaled) - 0.5) < 1e-6).tolist():
        out[i] = int(f"{x[i]:.2f}".replace(".", ""))
    return out


def _scored(out: ClusterBuilder, eligible: Array, combined: Array, target: Array, bounded: Array, weights: Array,
            factor_names: list[str], factor_values: list[Array], held: dict[int, str], params: EngineParams,
            extra: tuple[str, ...]) -> None:
    """The verdicts of the eligible endpoints (positions ``eligible``), array-wise: their factor maps
    and reasons are made once per distinct content (a few hundred among 60 000 endpoints) and shared.
    ``held``: ``{position: note}`` for endpoints flagged but not excluded yet."""
    m = len(eligible)
    out.weight[eligible], out.score[eligible], out.target[eligible] = weights, combined, target
    out.score_set[eligible] = 1
    if not m:
        return
    fgroup, ffirst = group_rows(factor_values, m)
    factor_rows = np.column_stack(factor_values)[ffirst].tolist() if factor_values else [[]] * len(ffirst)
    fids, fparts = [], []
    for row in factor_rows:
        fkey = tuple(zip(factor_names, row, strict=True))
        fids.append(out.factor_table.add(MappingProxyType(dict(fkey)), fkey))
        fparts.append("".join(f" x {fn} {fv:.3g}" for fn, fv in fkey if fv != 1.0))
    out.factors[eligible] = np.array(fids, dtype=np.int32)[fgroup]
    notes = list(held.values())
    note_of = np.full(len(out.weight), -1, dtype=np.int64)
    for k, i in enumerate(held):
        note_of[i] = k
    score2 = hundredths(combined)
    group, first = group_rows([score2, fgroup, target, bounded, weights, note_of[eligible]], m)
    max_weight, growth = f"{params.max_weight:g}", f"{1 + (params.max_change or 0):g}"
    hysteresis = f"{params.hysteresis:g}"
    rids = []
    for s2, fg, tgt, bnd, weight, note in zip(score2[first].tolist(), fgroup[first].tolist(), target[first].tolist(),
                                              bounded[first].tolist(), weights[first].tolist(),
                                              note_of[eligible][first].tolist(), strict=True):
        reasons = [f"score {s2 // 100}.{s2 % 100:02d} x max_weight {max_weight}{fparts[fg]} -> {tgt}"]
        if bnd != tgt:
            reasons.append(f"bounded to {bnd}: at most x{growth} per round")
        if weight != bnd:
            reasons.append(f"held at {weight}: change under hysteresis {hysteresis}")
        reasons.extend(extra)
        if note >= 0:
            reasons.append(notes[note])
        rids.append(out.reason_table.add(tuple(reasons)))
    out.reasons[eligible] = np.array(rids, dtype=np.int32)[group]


def _cluster(
    cluster: str, members: list[EndpointSpec], addresses: tuple[str, ...], stats: Mapping[str, EndpointStats],
    prev: ClusterMemory | None,
    prev_plugins: Mapping[str, Mapping[str, Any]], params: EngineParams, now: float, plugins: PluginSet,
    scorer_weights: Mapping[str, float],
) -> tuple[ClusterVerdicts, Array, dict[str, dict[str, Any]]]:
    """One cluster, array-wise: each step is a few numpy operations over the cluster's members; Python
    loops walk only the endpoints some rule singles out (draining, stale, filtered, ejected, ramping).
    Returns the verdicts (before the uint32 fit), which endpoints are eligible (bool) and the plugins' states."""
    cap = MAX_WEIGHT_SUM  # one weight; the cluster's sum is fitted at the end (fit_uint32)
    n = len(members)
    raw_stats = [stats.get(s.instance, _NO_STATS) for s in members]
    columns = Columns.of(members, raw_stats)
    seen = raw_stats
    for i in np.flatnonzero(columns.dirty).tolist():
        seen[i] = raw_stats[i].sanitized()
    draining = np.fromiter((s.draining for s in members), dtype=bool, count=n)
    live = np.flatnonzero(~draining)
    was_weight, was_eligible = prev.aligned(addresses) if prev is not None else (np.full(n, np.nan),
                                                                                  np.zeros(n, dtype=bool))
    first_round = bool(np.isnan(was_weight).all())
    # Endpoints no longer configured are forgotten. The states are read-only mappings (plugins return
    # new ones), passed on as they are when no address can be missing: the same addresses as last
    # round (compared in ~0.4 ms at 60 000; checking every key of every state took ~10 ms each, in one
    # C call holding the GIL).
    if prev is not None and prev.addresses == addresses:
        state: dict[str, Mapping[str, Any]] = dict(prev_plugins)
    else:
        configured = set(addresses)
        state = {name: v if v.keys() <= configured else {a: x for a, x in v.items() if a in configured}
                 for name, v in prev_plugins.items()}
    base = ClusterRound(cluster, now, addresses, tuple(members), columns, len(live), first_round, params)
    out = ClusterBuilder(n)

    def old_weight(i: int) -> int | None:
        w = was_weight[i]
        return None if w != w else int(w)

    def build(score_names: tuple[str, ...] = (), scores: Array | None = None) -> ClusterVerdicts:
        return out.build(cluster, addresses, seen, columns.matrix, score_names,
                         np.full((n, 0), np.nan) if scores is None else scores)

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
        out.one(i, min(old_weight(i) or 1, cap), DRAINING, (reason,), removed=removed)

    age = columns.stats["sample_age_s"]
    stale = np.isnan(age) | (age > params.stale_after_s)
    if len(live) and stale[live].all():
        ok = np.zeros(n, dtype=bool)
        ok[live] = was_eligible[live]
        kept = ("metrics of every endpoint in the cluster are stale: last weights kept",)
        for i in live.tolist():
            old = old_weight(i)
            weight = old if old is not None else max(1, round(params.max_weight * members[i].capacity * NEUTRAL_SCORE))
            out.one(i, max(1, min(weight, cap)), HEALTHY, kept)
        return build(), ok, state  # type: ignore[return-value]

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

    # Per filter: its reason or "pass" where it ran on the endpoint, else "off" or "not run".
    def verdict_map(given: list[tuple[str, str]]) -> Mapping[str, str]:
        verdicts = dict(given)
        for name in plugins.filters:
            verdicts.setdefault(name, "off" if name in params.disabled else "not run")
        return MappingProxyType(verdicts)

    passed, unjudged = verdict_map([(r, "pass") for r in ran]), verdict_map([])

    def verdicts(address: str) -> Mapping[str, str]:
        given = judged.get(address)
        return verdict_map(given) if given is not None else unjudged if address in stale_out else passed

    # Health hysteresis: one round's verdict changes nothing (saturation and one odd window are not health).
    # Only flagged or excluded endpoints keep a record: a record of passes alone acts as no record.
    health_prev = state.get(HEALTH, {})
    health: dict[str, tuple[int, int, bool]] = {}
    held: dict[int, str] = {}
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
            held[index[a]] = note
        elif a not in filtered and rec[2]:
            filtered[a] = f"recovering: passed {rec[1]} of {params.health_rounds} rounds since its exclusion"
    state[HEALTH] = health
    out_now = np.fromiter((a in filtered for a in (addresses[i] for i in pool.tolist())), dtype=bool,
                          count=len(pool)) if filtered else np.zeros(len(pool), dtype=bool)
    eligible = pool[~out_now]

    extra: tuple[str, ...] = ()
    if not len(eligible) and filtered:
        eligible = pool[out_now]
        extra = ("every endpoint was filtered out; none excluded (an empty cluster is an outage)",)
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
    raw = params.max_weight * combined
    factor_names: list[str] = []
    factor_values: list[Array] = []
    for name, fa in plugins.factors.items():
        if name in params.disabled:
            continue
        so_far = raw.copy()
        so_far.flags.writeable = False
        mults, state[name] = fa.run(rnd, plugin_params(name, params, plugins), state.get(name, {}), so_far)
        mults = np.broadcast_to(np.asarray(mults, dtype=float), (m,))
        mults = np.where(np.isfinite(mults) & (mults > 0), mults, 1.0)
        raw = raw * mults
        factor_names.append(name)
        factor_values.append(mults)

    # Stability, element-wise: bounded change against the last weight (if eligible then), quantised, held.
    step = max(1, round(params.quantum * params.max_weight))
    was = np.where(was_eligible, was_weight, np.nan)[eligible]
    target = np.minimum(cap, stability.quantize(raw, step))
    bounded = np.minimum(cap, stability.quantize(stability.bound(was, raw, params.max_change), step))
    weights = np.maximum(1.0, np.minimum(cap, stability.hold(was, bounded, params.hysteresis))).astype(np.int64)

    _scored(out, eligible, combined, target.astype(np.int64), bounded.astype(np.int64), weights, factor_names,
            factor_values, held, params, extra)
    out.filters[eligible] = out.filter_id(passed)
    for a in judged:
        if a not in excluded:  # flagged, not excluded yet (or every endpoint was): still scored
            out.filters[index[a]] = out.filter_id(verdicts(a))
    for a, why in excluded.items():
        i = index[a]
        out.one(i, max(1, min(old_weight(i) or 1, cap)), UNHEALTHY, (why,), verdicts(a))
    score_matrix = np.full((n, len(scores)), np.nan)
    if scores:
        score_matrix[eligible] = np.column_stack([np.broadcast_to(v, (m,)) for v in scores.values()])
    ok = np.zeros(n, dtype=bool)
    ok[eligible] = True
    return build(tuple(scores), score_matrix), ok, state  # type: ignore[return-value]
