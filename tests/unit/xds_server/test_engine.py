"""The weight engine: filters, scorers, stability and the pipeline's pool-wide rules (C02, C04, C05)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from tests.support.factories import config, same_stats, score, service, spec, specs, stats, version
from xds_server.control import endpoint_specs, engine_params
from xds_server.engine import stability
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import MAX_WEIGHT_SUM, NEUTRAL_SCORE, combine, compute_weights
from xds_server.engine.plugin import Filter, NoParams, PluginSet
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EngineParams, EngineState
from xds_server.metrics.stats import EndpointStats

P = EngineParams()
NO_HYSTERESIS = EngineParams(hysteresis=0.0)
BUSY = {"gpu_util": 0.5, "running": 2.0, "queue": 0.0, "latency_mean_ms": 100.0}


def run(endpoints, seen, prev=None, params=P):
    weights, state = compute_weights(endpoints, seen, prev or EngineState(), params, plugins=BUILTIN)
    return {w.address: w for w in weights}, state


def cluster_sums(weights) -> dict[str, int]:
    sums: dict[str, int] = {}
    for w in weights:
        sums[w.cluster] = sums.get(w.cluster, 0) + w.weight
    return sums


# --- C02: weights are >= 1 and sums fit uint32 ----------------------------------------------------


def test_150_endpoints_sharing_a_small_budget_all_get_at_least_1():
    eps = specs(150)
    seen = {s.instance: stats(gpu_util=(i % 100) / 100, running=float(i % 8), latency_mean_ms=10.0 + i)
            for i, s in enumerate(eps)}
    weights, _ = compute_weights(eps, seen, EngineState(), EngineParams(max_weight=1), plugins=BUILTIN)
    assert len(weights) == 150
    assert all(w.weight >= 1 for w in weights)
    assert all(w.health == HEALTHY for w in weights)


def test_150_endpoints_with_a_huge_max_weight_stay_within_uint32():
    eps = specs(150)
    weights, _ = compute_weights(eps, same_stats(eps, gpu_util=0.0, running=0.0), EngineState(),
                                 EngineParams(max_weight=10**12), plugins=BUILTIN)
    assert sum(w.weight for w in weights) <= MAX_WEIGHT_SUM
    assert all(1 <= w.weight <= MAX_WEIGHT_SUM for w in weights)


def test_weights_scaled_to_fit_uint32_keep_their_ratios():
    """Issue 15 item 7: 500 endpoints, max_weight 10**6, capacities 30 and 3, scores 0.2..1. Capping
    each weight at uint32 / 500 made them all 8 589 934; the whole assignment is scaled instead."""
    eps = [spec(i, capacity=30.0 if i % 2 else 3.0) for i in range(500)]
    seen = {s.instance: stats(gpu_util=0.8 * (i % 5) / 4) for i, s in enumerate(eps)}
    params = EngineParams(max_weight=10**6, quantum=0.0, hysteresis=0.0)
    weights, state = compute_weights(eps, seen, EngineState(), params, plugins=BUILTIN)
    assert sum(w.weight for w in weights) <= MAX_WEIGHT_SUM
    assert len({w.weight for w in weights}) == 10  # 2 capacities x 5 scores, not one clamped value
    ideal = [w.target for w in weights]
    for w, t in zip(weights, ideal, strict=True):
        assert w.weight / weights[0].weight == pytest.approx(t / ideal[0], rel=1e-5)
        assert "past uint32" in w.reasons[-1]
    again, _ = compute_weights(eps, seen, state, params, plugins=BUILTIN)  # stable round after round
    assert [w.weight for w in again] == [w.weight for w in weights]


def test_all_zero_scores_still_give_weight_1():
    eps = specs(5)
    # idle compute 0 (GPU at 100 %), concurrency headroom 0 (7 running + 1 queued of 8), KV cache full,
    # every request failing; no latency data. The queue scorer is off (one queued request scores 0.89).
    params = replace(P, scorer_weights={**P.scorer_weights, "queue": 0.0})
    seen = same_stats(eps, gpu_util=1.0, running=7.0, queue=1.0, kv_cache=1.0, error_rate=1.0)
    weights, _ = compute_weights(eps, seen, EngineState(), params, plugins=BUILTIN)
    for w in weights:
        assert w.score == 0.0
        assert w.weight == 1
        assert w.health == HEALTHY


def test_weight_follows_max_weight_capacity_and_score():
    eps = [spec(0), spec(1, capacity=0.4, gpu_class="a10")]
    out, _ = run(eps, same_stats(eps, gpu_util=0.25), params=EngineParams(max_weight=100))
    # only idle compute has data: score 0.75
    assert out[eps[0].address].score == pytest.approx(0.75)
    assert out[eps[0].address].weight == round(100 * 1.0 * 0.75)
    assert out[eps[1].address].weight == round(100 * 0.4 * 0.75)


# --- C04: stale metrics are not "idle" ------------------------------------------------------------


def test_stale_endpoint_is_unhealthy_while_others_are_fresh():
    eps = specs(3)
    seen = same_stats(eps, **BUSY)
    # The stale one "looks empty": queue 0, KV 0, GPU idle - it must not attract traffic.
    seen[eps[0].instance] = stats(gpu_util=0.0, running=0.0, queue=0.0, kv_cache=0.0, sample_age_s=16.0)
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == UNHEALTHY
    assert "stale" in out[eps[0].address].reasons[0]
    assert out[eps[0].address].score is None
    assert out[eps[1].address].health == HEALTHY
    assert out[eps[2].address].health == HEALTHY


def test_never_seen_endpoint_is_unhealthy():
    eps = specs(3)
    seen = same_stats(eps[1:], **BUSY)  # eps[0] missing from the stats altogether
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == UNHEALTHY
    assert "never seen" in out[eps[0].address].reasons[0]


def test_sample_age_none_counts_as_never_seen():
    eps = specs(2)
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = EndpointStats(gpu_util=0.0, sample_age_s=None)
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == UNHEALTHY


@pytest.mark.parametrize(("age", "health"), [(15.0, HEALTHY), (15.001, UNHEALTHY), (0.0, HEALTHY)])
def test_staleness_limit_is_strictly_greater_than(age, health):
    eps = specs(2)
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = stats(**BUSY, sample_age_s=age)
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == health


def test_staleness_limit_is_a_parameter():
    eps = specs(2)
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = stats(**BUSY, sample_age_s=6.0)
    out, _ = run(eps, seen, params=EngineParams(stale_after_s=5.0))
    assert out[eps[0].address].health == UNHEALTHY


def test_stale_endpoint_keeps_its_weight_value_but_not_its_health():
    eps = specs(2)
    _, state = run(eps, same_stats(eps, **BUSY))
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = stats(**BUSY, sample_age_s=60.0)
    out, _ = run(eps, seen, prev=state)
    assert out[eps[0].address].health == UNHEALTHY
    assert out[eps[0].address].weight == state.weights[(eps[0].cluster, eps[0].address)]


# --- C05: everything stale at once ----------------------------------------------------------------


def test_all_stale_excludes_nothing_and_keeps_the_last_weights():
    eps = [spec(0), spec(1), spec(2, capacity=0.4, gpu_class="a10")]
    seen = {eps[0].instance: stats(gpu_util=0.1, running=1.0, latency_mean_ms=50.0),
            eps[1].instance: stats(gpu_util=0.9, running=6.0, latency_mean_ms=200.0),
            eps[2].instance: stats(gpu_util=0.5, running=3.0, latency_mean_ms=120.0)}
    first, state = run(eps, seen)
    assert len({w.weight for w in first.values()}) == 3  # they differ, so "kept" is observable
    stale = {inst: replace(s, sample_age_s=120.0) for inst, s in seen.items()}
    stale[eps[2].instance] = EndpointStats()  # and one never seen at all
    out, state2 = run(eps, stale, prev=state)
    for e in eps:
        assert out[e.address].health == HEALTHY
        assert out[e.address].weight == first[e.address].weight
        assert "stale" in out[e.address].reasons[0]
    assert dict(state2.weights) == dict(state.weights)


def test_all_stale_on_the_first_round_gives_neutral_weights():
    eps = [spec(0), spec(1, capacity=0.4, gpu_class="a10")]
    out, _ = run(eps, {})  # nothing ever seen (Prometheus down from the start)
    assert out[eps[0].address].weight == round(P.max_weight * 1.0 * NEUTRAL_SCORE)
    assert out[eps[1].address].weight == round(P.max_weight * 0.4 * NEUTRAL_SCORE)
    assert {w.health for w in out.values()} == {HEALTHY}


def test_all_stale_ignores_the_filters():
    eps = specs(2)
    seen = same_stats(eps, gpu_mem_free_mib=10.0, running=99.0, sample_age_s=100.0)
    out, _ = run(eps, seen)
    assert {w.health for w in out.values()} == {HEALTHY}


def test_all_stale_is_decided_per_cluster():
    a, b = specs(2, "svc-a"), specs(2, "svc-b")
    seen = same_stats(b, **BUSY)
    seen[b[0].instance] = stats(**BUSY, sample_age_s=99.0)  # b: one stale of two -> excluded
    out, _ = run(a + b, seen)  # a: never seen at all -> all stale -> kept
    assert out[a[0].address].health == HEALTHY and out[a[1].address].health == HEALTHY
    assert out[b[0].address].health == UNHEALTHY
    assert out[b[1].address].health == HEALTHY


def test_draining_endpoints_do_not_count_for_all_stale():
    eps = [spec(0, draining=True), spec(1), spec(2)]
    seen = same_stats(eps, **BUSY)
    seen[eps[1].instance] = stats(**BUSY, sample_age_s=30.0)
    seen[eps[2].instance] = stats(**BUSY, sample_age_s=30.0)
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == DRAINING
    assert out[eps[1].address].health == HEALTHY  # the live ones are all stale: kept
    assert out[eps[2].address].health == HEALTHY


# --- filters --------------------------------------------------------------------------------------


def rounds(eps, seen, n, params=P):
    """``n`` rounds, 1 s apart, on the same stats; the last round's verdicts."""
    state = EngineState()
    for i in range(n):
        weights, state = compute_weights(eps, seen, state, params, float(i), plugins=BUILTIN)
    return {w.address: w for w in weights}, state


# Issue 13: saturation is not health. These replace the old one-sample exclusions
# (test_gpu_memory_filter_adds_the_20_percent_margin, test_max_concurrency_filter,
# test_max_concurrency_is_per_endpoint asserted UNHEALTHY after one round).
@pytest.mark.parametrize(("free", "short"), [(2457.0, True), (2457.6, False), (2458.0, False),
                                            (2048.0, True), (None, False)])
def test_gpu_memory_short_lowers_the_weight_after_3_rounds_never_the_health(free, short):
    eps = specs(2)
    seen = same_stats(eps, **BUSY, gpu_mem_free_mib=80000.0)
    seen[eps[0].instance] = stats(**BUSY, gpu_mem_free_mib=free)  # request 2048 MiB + 20 % = 2457.6 MiB
    for n in (1, 2, 3, 4):
        out, _ = rounds(eps, seen, n)
        assert out[eps[0].address].health == HEALTHY
        derated = out[eps[0].address].factors["gpu_memory"] < 1.0
        assert derated == (short and n >= 3)
    if short:
        assert out[eps[0].address].factors["gpu_memory"] == 0.5
        assert out[eps[0].address].weight < out[eps[1].address].weight


def test_gpu_memory_uses_the_engine_request_and_margin():
    eps = specs(1)
    params = EngineParams(request_memory_mib=1000.0, memory_margin=0.5)
    out, _ = rounds(eps, same_stats(eps, gpu_mem_free_mib=1499.0), 3, params)
    assert out[eps[0].address].factors["gpu_memory"] == 0.5
    out, _ = rounds(eps, same_stats(eps, gpu_mem_free_mib=1500.0), 3, params)
    assert out[eps[0].address].factors["gpu_memory"] == 1.0


@pytest.mark.parametrize(("running", "short"), [(8.0, True), (9.5, True), (7.9, False)])
def test_max_concurrency_never_excludes_and_derates_only_a_persistent_shortage(running, short):
    eps = specs(2, max_concurrency=8)
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = stats(gpu_util=0.2, running=running, latency_mean_ms=100.0)
    one, _ = rounds(eps, seen, 1)
    assert one[eps[0].address].health == HEALTHY and one[eps[0].address].factors["max_concurrency"] == 1.0
    out, _ = rounds(eps, seen, 3)
    assert out[eps[0].address].health == HEALTHY
    assert (out[eps[0].address].factors["max_concurrency"] < 1.0) == short


def test_max_concurrency_is_per_endpoint():
    eps = [spec(0, max_concurrency=4), spec(1, max_concurrency=16)]
    out, _ = rounds(eps, same_stats(eps, running=5.0), 3)
    assert out[eps[0].address].factors["max_concurrency"] == 0.5
    assert out[eps[1].address].factors["max_concurrency"] == 1.0
    assert all(w.health == HEALTHY for w in out.values())


def test_a_saturation_burst_does_not_restart_slow_start():
    """One endpoint at max concurrency for 2 rounds, then calm: it stays at full weight, no ramp."""
    eps = specs(2, max_concurrency=8)
    calm = same_stats(eps, **BUSY)
    hot = {**calm, eps[0].instance: stats(gpu_util=0.5, running=8.0, queue=4.0, latency_mean_ms=100.0,
                                          gpu_mem_free_mib=10.0)}
    state = EngineState()
    for i, seen in enumerate([calm, hot, hot, calm, calm]):
        weights, state = compute_weights(eps, seen, state, P, float(i * 40), plugins=BUILTIN)
        out = {w.address: w for w in weights}
        assert out[eps[0].address].health == HEALTHY
        assert out[eps[0].address].factors["slow_start"] == 1.0


def test_a_shortage_is_restored_after_as_many_calm_rounds():
    eps = specs(2, max_concurrency=8)
    hot = same_stats(eps, **BUSY)
    hot[eps[0].instance] = stats(running=8.0)
    calm = same_stats(eps, **BUSY)
    state = EngineState()
    seen_factors = []
    for i, seen in enumerate([hot, hot, hot, calm, calm, calm]):
        weights, state = compute_weights(eps, seen, state, P, float(i), plugins=BUILTIN)
        seen_factors.append(weights[0].factors["max_concurrency"])
    assert seen_factors == [1.0, 1.0, 0.5, 0.5, 0.5, 1.0]


def _busy_filter(rnd, _p, state):
    busy = np.nan_to_num(rnd.stat("running"), nan=0.0) >= 8.0
    return {a: "busy" for a, b in zip(rnd.addresses, busy.tolist(), strict=True) if b}, state


#: The built-in plugins plus a filter that flags every endpoint running >= 8 (momentary load is no
#: built-in filter any more: these tests are about the pipeline's "never all" rule).
BUSY_FILTERED = PluginSet({**BUILTIN.filters, "busy": Filter("busy", NoParams, _busy_filter)},
                          BUILTIN.scorers, BUILTIN.factors)


def test_when_every_endpoint_would_be_filtered_none_is_excluded():
    eps = specs(3)
    seen = same_stats(eps, running=8.0, gpu_mem_free_mib=100.0, gpu_util=0.9)
    state = EngineState()
    for i in range(3):
        weights, state = compute_weights(eps, seen, state, P, float(i), plugins=BUSY_FILTERED)
    for w in weights:
        assert w.health == HEALTHY
        assert w.weight >= 1
        assert any("none excluded" in r for r in w.reasons)


def test_filtered_endpoints_are_kept_when_the_rest_is_stale():
    eps = specs(3)
    seen = {eps[0].instance: stats(sample_age_s=40.0, gpu_util=0.0),
            eps[1].instance: stats(running=9.0),
            eps[2].instance: stats(running=10.0)}
    weights, _ = compute_weights(eps, seen, EngineState(), replace(P, health_rounds=1), plugins=BUSY_FILTERED)
    out = {w.address: w for w in weights}
    assert out[eps[0].address].health == UNHEALTHY  # stale: out
    assert out[eps[1].address].health == HEALTHY  # filtered, but the cluster must not be empty
    assert out[eps[2].address].health == HEALTHY


@pytest.mark.parametrize("health_rounds", [1, 2, 3])
def test_a_filter_excludes_only_after_health_rounds_flagged_rounds_and_readmits_after_as_many_passes(
        health_rounds):
    eps = specs(3)
    calm = same_stats(eps, running=1.0)
    hot = {**calm, eps[0].instance: stats(running=8.0)}
    params = replace(P, health_rounds=health_rounds)
    state = EngineState()
    healths = []
    for i, seen in enumerate([hot, calm, *[hot] * health_rounds, *[calm] * health_rounds]):
        weights, state = compute_weights(eps, seen, state, params, float(i), plugins=BUSY_FILTERED)
        healths.append(weights[0].health)
    # one flagged round then a pass: excluded only when health_rounds is 1 (and back after 1 pass)
    assert healths[0] == (UNHEALTHY if health_rounds == 1 else HEALTHY)
    assert healths[1] == HEALTHY
    flagged = healths[2:2 + health_rounds]
    assert flagged == [HEALTHY] * (health_rounds - 1) + [UNHEALTHY]
    passed = healths[2 + health_rounds:]
    assert passed == [UNHEALTHY] * (health_rounds - 1) + [HEALTHY]
    if health_rounds > 1:
        w = compute_weights(eps, hot, EngineState(), params, 0.0, plugins=BUSY_FILTERED)[0][0]
        assert any("not excluded yet" in r for r in w.reasons)


def test_draining_endpoint_is_draining_and_others_are_unaffected():
    eps = [spec(0, draining=True), spec(1)]
    out, _ = run(eps, same_stats(eps, **BUSY))
    assert out[eps[0].address].health == DRAINING
    assert out[eps[0].address].weight >= 1
    assert out[eps[1].address].health == HEALTHY


def test_draining_wins_over_staleness_and_filters():
    eps = [spec(0, draining=True), spec(1), spec(2)]
    seen = same_stats(eps, **BUSY)
    seen[eps[0].instance] = stats(running=99.0, sample_age_s=99.0)
    out, _ = run(eps, seen)
    assert out[eps[0].address].health == DRAINING


# --- scorers and their combination ---------------------------------------------------------------


def test_a10_with_slower_latency_gets_a_lower_weight_than_a100s():
    cfg = config([service("llm", [version("v1", [
        {"address": "10.0.0.1:8000", "gpu_class": "a100"},
        {"address": "10.0.0.2:8000", "gpu_class": "a100"},
        {"address": "10.0.0.3:8000", "gpu_class": "a10"},
    ])])], gpu_classes={"a10": {"capacity": 0.4, "memory_mib": 24576}})
    eps = endpoint_specs(cfg)
    assert [e.capacity for e in eps] == [1.0, 1.0, pytest.approx(0.4)]
    seen = same_stats(eps, gpu_util=0.5, running=2.0, latency_mean_ms=100.0)
    seen["10.0.0.3:8000"] = stats(gpu_util=0.5, running=2.0, latency_mean_ms=250.0)
    out, _ = run(eps, seen, params=engine_params(cfg))
    a10 = out["10.0.0.3:8000"]
    for a100 in ("10.0.0.1:8000", "10.0.0.2:8000"):
        assert a10.weight < out[a100].weight
    # 2.5x slower is exactly as slow as an A10 (capacity 0.4) should be: the capacity factor alone
    # lowers its weight, the latency score does not punish it a second time.
    assert a10.scores["latency"] == pytest.approx(1.0)
    assert a10.factors["capacity"] == pytest.approx(0.4)
    assert a10.weight == pytest.approx(0.4 * out["10.0.0.1:8000"].weight, abs=1)
    assert out["10.0.0.1:8000"].weight == out["10.0.0.2:8000"].weight
    # slower than its class should be: the latency score drops
    seen["10.0.0.3:8000"] = stats(gpu_util=0.5, running=2.0, latency_mean_ms=500.0)
    out, _ = run(eps, seen, params=engine_params(cfg))
    assert out["10.0.0.3:8000"].scores["latency"] == pytest.approx(0.5)


def test_busier_endpoint_gets_less():
    eps = specs(2)
    seen = {eps[0].instance: stats(gpu_util=0.2, running=1.0, latency_mean_ms=80.0),
            eps[1].instance: stats(gpu_util=0.8, running=6.0, latency_mean_ms=160.0)}
    out, _ = run(eps, seen)
    assert out[eps[0].address].weight > out[eps[1].address].weight


@pytest.mark.parametrize(
    ("own", "pool", "expected"),
    [(100.0, [100.0, 50.0], 0.5), (50.0, [100.0, 50.0], 1.0), (10.0, [50.0], 1.0),
     (1e9, [1e-3], 1e-12), (0.0, [10.0], None), (-5.0, [10.0], None), (None, [10.0], None),
     (10.0, [None, 0.0], 1.0)],  # the only one with data is the pool's best
)
def test_latency_scorer_is_relative_and_bounded(own, pool, expected):
    got = score("latency", spec(0), stats(latency_mean_ms=own), [stats(latency_mean_ms=v) for v in pool])
    if expected is None:
        assert got is None
    else:
        assert 0.0 <= got <= 1.0
        assert got == pytest.approx(expected)


@pytest.mark.parametrize(("util", "expected"), [(0.0, 1.0), (0.3, 0.7), (1.0, 0.0), (1.7, 0.0), (-0.5, 1.0),
                                                (None, None)])
def test_idle_compute_scorer(util, expected):
    got = score("idle_compute", spec(0), stats(gpu_util=util))
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(("running", "queue", "expected"),
                         [(0.0, None, 1.0), (2.0, 2.0, 0.5), (6.0, 6.0, 0.0), (None, 3.0, None)])
def test_concurrency_scorer_counts_the_queue(running, queue, expected):
    got = score("concurrency", spec(0, max_concurrency=8), stats(running=running, queue=queue))
    assert got == (None if expected is None else pytest.approx(expected))


def test_combine_is_a_weighted_mean_of_the_scores_with_data():
    assert combine({"a": 1.0, "b": 0.0}, {"a": 3.0, "b": 1.0}) == pytest.approx(0.75)
    assert combine({"a": 1.0, "b": None}, {"a": 1.0, "b": 1.0}) == pytest.approx(1.0)
    assert combine({"a": 0.2, "b": 0.9}, {"a": 1.0, "b": 0.0}) == pytest.approx(0.2)  # weight 0 = off
    assert combine({"a": None}, {"a": 1.0}) == NEUTRAL_SCORE
    assert combine({}, {}) == NEUTRAL_SCORE


def test_scorer_weight_zero_turns_a_scorer_off():
    eps = specs(2)
    seen = {eps[0].instance: stats(gpu_util=0.5, latency_mean_ms=100.0),
            eps[1].instance: stats(gpu_util=0.5, latency_mean_ms=400.0)}
    params = EngineParams(scorer_weights={"idle_compute": 1.0, "concurrency": 1.0, "latency": 0.0})
    out, _ = run(eps, seen, params=params)
    assert out[eps[0].address].weight == out[eps[1].address].weight
    out, _ = run(eps, seen)
    assert out[eps[0].address].weight > out[eps[1].address].weight


def test_no_data_at_all_but_fresh_gives_the_neutral_score():
    eps = specs(2)
    out, _ = run(eps, same_stats(eps))
    for w in out.values():
        assert w.score == NEUTRAL_SCORE
        assert set(w.scores.values()) == {None}


def test_scores_are_finite_and_within_0_1():
    eps = specs(6)
    seen = {s.instance: stats(gpu_util=u, running=r, queue=q, latency_mean_ms=lat)
            for s, (u, r, q, lat) in zip(eps, [(0.0, 0.0, 0.0, 1e-9), (1.0, 7.9, 50.0, 1e9), (2.0, -1.0, None, 5.0),
                                               (-1.0, 0.0, 0.0, 0.0), (0.5, None, 3.0, None), (0.1, 1.0, 1.0, 1e300)],
                                         strict=True)}
    weights, _ = compute_weights(eps, seen, EngineState(), P, plugins=BUILTIN)
    for w in weights:
        assert w.score is None or (math.isfinite(w.score) and 0.0 <= w.score <= 1.0)
        for v in w.scores.values():
            assert v is None or (math.isfinite(v) and 0.0 <= v <= 1.0)
        assert w.weight >= 1


@pytest.mark.parametrize("field", ["running", "gpu_util", "latency_mean_ms", "queue"])
def test_non_finite_stats_do_not_crash_the_engine(field):
    eps = specs(2)
    bad = math.inf if field == "latency_mean_ms" else math.nan
    seen = same_stats(eps, gpu_util=0.5, running=1.0, queue=0.0, latency_mean_ms=100.0)
    seen = {i: replace(s, **{field: bad}) for i, s in seen.items()}
    weights, _ = compute_weights(eps, seen, EngineState(), P, plugins=BUILTIN)
    for w in weights:
        assert w.weight >= 1
        assert w.score is None or 0.0 <= w.score <= 1.0


# --- stability ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prev", "target", "h", "expected"),
                         [(100, 95, 0.1, 100), (100, 110, 0.1, 100), (100, 89, 0.1, 89), (100, 111, 0.1, 111),
                          (None, 7, 0.1, 7), (0, 7, 0.5, 7), (100, 99, 0.0, 99)])
def test_hold(prev, target, h, expected):
    assert stability.hold(prev, target, h) == expected


def test_hysteresis_holds_small_changes_and_passes_large_ones():
    eps = specs(2)
    seen = same_stats(eps, gpu_util=0.2, running=2.0)
    first, state = run(eps, seen)
    w0 = first[eps[0].address].weight
    # slightly busier: the target moves by a few percent -> held
    seen2 = dict(seen)
    seen2[eps[0].instance] = stats(gpu_util=0.25, running=2.0)
    out, state2 = run(eps, seen2, prev=state)
    target = round(P.max_weight * out[eps[0].address].score)
    assert target != w0 and abs(target - w0) <= P.hysteresis * w0
    assert out[eps[0].address].weight == w0
    assert any("held" in r for r in out[eps[0].address].reasons)
    # much busier: passes
    seen3 = dict(seen)
    seen3[eps[0].instance] = stats(gpu_util=0.9, running=6.0)
    out3, _ = run(eps, seen3, prev=state2)
    assert out3[eps[0].address].weight < w0 * (1 - P.hysteresis)
    # without hysteresis the small change passes too
    out4, _ = run(eps, seen2, prev=state, params=NO_HYSTERESIS)
    assert out4[eps[0].address].weight == target


# --- shape of the result --------------------------------------------------------------------------


def test_result_is_in_spec_order_across_interleaved_clusters():
    a, b = specs(3, "x-v1"), specs(3, "x-v2")
    interleaved = [a[0], b[0], a[1], b[1], b[2], a[2]]
    weights, state = compute_weights(interleaved, same_stats(interleaved, **BUSY), EngineState(), P, plugins=BUILTIN)
    assert [(w.cluster, w.address) for w in weights] == [(s.cluster, s.address) for s in interleaved]
    assert set(state.weights) == {(s.cluster, s.address) for s in interleaved}
    assert all(state.weights[(w.cluster, w.address)] == w.weight for w in weights)


def test_same_address_in_two_clusters_is_kept_apart():
    a = spec(0, "llm-v1")
    b = replace(a, cluster="llm-v2")
    weights, state = compute_weights([a, b], {a.instance: stats(**BUSY)}, EngineState(), P, plugins=BUILTIN)
    assert len(weights) == 2 and len(state.weights) == 2


def test_engine_params_from_config():
    cfg = config(engine={"stale_after_s": 7, "request_memory_mib": 4096, "memory_margin": 0.5, "max_weight": 50,
                         "hysteresis": 0.2, "scorers": {"latency": 0, "idle_compute": 2}})
    p = engine_params(cfg)
    assert (p.stale_after_s, p.request_memory_mib, p.memory_margin, p.max_weight, p.hysteresis) == (
        7, 4096, 0.5, 50, 0.2)
    defaults = {name: s.default_weight for name, s in BUILTIN.scorers.items()}
    assert BUILTIN.scorer_weights(p.scorer_weights) == {**defaults, "idle_compute": 2.0, "latency": 0.0}


def test_endpoint_specs_from_config():
    cfg = config([
        service("llm", [version("v1", [{"address": "10.1.0.1:8000", "gpu_class": "h100", "max_concurrency": 32},
                                       {"address": "10.1.0.2:8000", "metrics_instance": "dcgm-2:9400"}]),
                        version("v2", [{"address": "10.1.0.3:8000", "gpu_class": "a10", "gpu_memory_mib": 1000}])]),
    ])
    eps = endpoint_specs(cfg)
    assert [(e.cluster, e.address) for e in eps] == [
        ("llm-v1", "10.1.0.1:8000"), ("llm-v1", "10.1.0.2:8000"), ("llm-v2", "10.1.0.3:8000")]
    assert eps[0].capacity == cfg.gpu_classes["h100"].capacity and eps[0].max_concurrency == 32
    assert eps[1].instance == "dcgm-2:9400"
    assert eps[2].memory_mib == 1000 and eps[2].capacity == cfg.gpu_classes["a10"].capacity
    assert not any(e.draining for e in eps)


def test_weights_fit_uint32_after_the_cluster_grows():
    eps = specs(11, capacity=1000.0)
    params = EngineParams(max_weight=10**6)  # 1e9 per endpoint: every weight sits at the per-endpoint cap
    seen = same_stats(eps, gpu_util=0.0, running=0.0, latency_mean_ms=10.0)
    first, state = compute_weights(eps[:10], seen, EngineState(), params, plugins=BUILTIN)
    assert sum(w.weight for w in first) <= MAX_WEIGHT_SUM
    grown, _ = compute_weights(eps, seen, state, params, plugins=BUILTIN)  # scale-up: an 11th endpoint joins
    assert sum(w.weight for w in grown) <= MAX_WEIGHT_SUM
