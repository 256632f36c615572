"""Properties of the weight engine over generated inputs (hypothesis)."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.support.factories import spec
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import MAX_WEIGHT_SUM, compute_weights
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointSpec, EngineParams, EngineState
from xds_server.metrics.stats import SIGNAL_FIELDS, EndpointStats

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Any finite float, including huge, tiny, zero and negative values (the dataclass takes any float).
any_float = st.floats(allow_nan=False, allow_infinity=False)
maybe = st.none() | any_float | st.sampled_from([0.0, -1.0, 1e308, -1e308, 5e-324])
realistic_age = st.none() | st.floats(min_value=-5.0, max_value=60.0) | st.sampled_from([15.0, 15.000001])

endpoint_stats = st.builds(
    EndpointStats,
    **{f: maybe for f in SIGNAL_FIELDS},
    sample_age_s=realistic_age,
)


@st.composite
def pools(draw, max_clusters: int = 3, max_size: int = 6) -> list[EndpointSpec]:
    """Endpoints of 1..3 clusters with varied capacity, concurrency and drain state (unique addresses)."""
    out = []
    for c in range(draw(st.integers(1, max_clusters))):
        for i in range(draw(st.integers(1, max_size))):
            out.append(spec(
                i, f"svc-v{c}",
                capacity=draw(st.floats(min_value=1e-3, max_value=1e4)),
                max_concurrency=draw(st.integers(1, 10_000)),
                draining=draw(st.integers(0, 4)) == 0,
            ))
    return out


params = st.builds(
    EngineParams,
    stale_after_s=st.floats(min_value=0.1, max_value=60.0),
    request_memory_mib=st.floats(min_value=0.0, max_value=1e6),
    memory_margin=st.floats(min_value=0.0, max_value=10.0),
    max_weight=st.integers(1, 10**12),
    hysteresis=st.floats(min_value=0.0, max_value=0.99),
    quantum=st.floats(min_value=0.0, max_value=1.0),
    max_change=st.none() | st.floats(min_value=0.01, max_value=10.0),
    drain_timeout_s=st.floats(min_value=0.1, max_value=600.0),
    disabled=st.frozensets(st.sampled_from(["gpu_memory", "max_concurrency", "oom", "latency_outlier", "capacity",
                                            "slow_start", "balance"])),
)


def stats_for(draw, endpoints, missing_ok=True) -> dict[str, EndpointStats]:
    seen = {}
    for s in endpoints:
        if missing_ok and draw(st.integers(0, 9)) == 0:
            continue  # never seen by the metrics source
        seen[s.instance] = draw(endpoint_stats)
    return seen


def check_invariants(endpoints, weights) -> None:
    assert [(w.cluster, w.address) for w in weights] == [(s.cluster, s.address) for s in endpoints]
    sums: dict[str, int] = {}
    for s, w in zip(endpoints, weights, strict=True):
        assert isinstance(w.weight, int) and w.weight >= 1
        assert w.health in (HEALTHY, UNHEALTHY, DRAINING)
        assert (w.health == DRAINING) == s.draining
        assert w.score is None or (math.isfinite(w.score) and 0.0 <= w.score <= 1.0)
        for v in w.scores.values():
            assert v is None or (math.isfinite(v) and 0.0 <= v <= 1.0)
        sums[w.cluster] = sums.get(w.cluster, 0) + w.weight
    assert all(total <= MAX_WEIGHT_SUM for total in sums.values()), sums
    # never an empty cluster: an all-excluded cluster is only allowed when every member drains
    by_cluster: dict[str, list] = {}
    for s, w in zip(endpoints, weights, strict=True):
        by_cluster.setdefault(s.cluster, []).append((s, w))
    for members in by_cluster.values():
        if not all(s.draining for s, _ in members):
            assert any(w.health == HEALTHY for _, w in members)


@SETTINGS
@given(data=st.data(), endpoints=pools(), p=params, clock=st.lists(st.floats(0.0, 400.0), min_size=2, max_size=4))
def test_weights_are_valid_for_any_input_over_several_rounds(data, endpoints, p, clock):
    state = EngineState()
    for now in sorted(clock):
        weights, state = compute_weights(endpoints, stats_for(data.draw, endpoints), state, p, now=now, plugins=BUILTIN)
        check_invariants(endpoints, weights)


@SETTINGS
@given(
    n=st.integers(100, 300),
    samples=st.lists(endpoint_stats, min_size=1, max_size=5),
    capacity=st.floats(min_value=1e-3, max_value=1e4),
    p=params,
)
def test_large_clusters_with_huge_max_weight_fit_uint32(n, samples, capacity, p):
    endpoints = [spec(i, "big", capacity=capacity) for i in range(n)]
    seen = {s.instance: samples[i % len(samples)] for i, s in enumerate(endpoints)}
    p = replace(p, max_weight=10**12)
    first, state = compute_weights(endpoints, seen, EngineState(), p,
                                   plugins=BUILTIN)
    check_invariants(endpoints, first)
    second, _ = compute_weights(endpoints, seen, state, p, now=1.0, plugins=BUILTIN)
    check_invariants(endpoints, second)


@SETTINGS
@given(data=st.data(), endpoints=pools(), p=params)
def test_same_inputs_same_outputs_in_any_order(data, endpoints, p):
    seen = stats_for(data.draw, endpoints)
    a, state_a = compute_weights(endpoints, seen, EngineState(), p,
                                   plugins=BUILTIN)
    b, state_b = compute_weights(endpoints, seen, EngineState(), p,
                                   plugins=BUILTIN)
    assert a == b and dict(state_a.weights) == dict(state_b.weights)
    shuffled = data.draw(st.permutations(endpoints))
    c, _ = compute_weights(shuffled, seen, EngineState(), p,
                                   plugins=BUILTIN)
    by_key = {(w.cluster, w.address): w for w in c}
    assert all(by_key[(w.cluster, w.address)] == w for w in a)


def effective(w) -> int:
    """The traffic share an endpoint can get: nothing unless HEALTHY."""
    return w.weight if w.health == HEALTHY else 0


positive = st.floats(min_value=1e-3, max_value=1e6)
fraction = st.floats(min_value=0.0, max_value=1.0)
fresh_stats = st.builds(
    EndpointStats,
    latency_mean_ms=positive,
    latency_p95_ms=st.none() | positive,
    queue=st.floats(min_value=0.0, max_value=100.0),
    running=st.floats(min_value=0.0, max_value=100.0),
    gpu_util=fraction,
    gpu_mem_free_mib=st.floats(min_value=0.0, max_value=1e5),
    kv_cache=fraction,
    error_rate=fraction,
    client_latency_p95_ms=st.none() | positive,
    sample_age_s=st.none() | st.floats(min_value=0.0, max_value=30.0),
)
#: field -> direction of "worse" (+1: higher is worse, -1: lower is worse)
WORSE = {"latency_mean_ms": 1, "latency_p95_ms": 1, "gpu_util": 1, "running": 1, "queue": 1, "kv_cache": 1,
         "error_rate": 1, "gpu_mem_free_mib": -1, "sample_age_s": 1}


@SETTINGS
@given(
    data=st.data(),
    n=st.integers(1, 8),
    field=st.sampled_from(sorted(WORSE)),
    p=params,
)
def test_a_worse_signal_never_raises_the_weight(data, n, field, p):
    p = replace(p, hysteresis=0.0, max_weight=data.draw(st.integers(1, 10**6)))
    endpoints = [spec(i, "mono", capacity=data.draw(st.floats(min_value=0.1, max_value=4.0)),
                      max_concurrency=data.draw(st.integers(1, 64)), memory_mib=81920.0) for i in range(n)]
    seen = {s.instance: data.draw(fresh_stats) for s in endpoints}
    target = data.draw(st.sampled_from(endpoints))
    before = seen[target.instance]
    old = getattr(before, field)
    assume(old is not None)
    step = data.draw(st.floats(min_value=1e-6, max_value=1e3))
    worse = old + step if WORSE[field] > 0 else max(0.0, old - step)
    if field in ("gpu_util", "kv_cache", "error_rate"):
        worse = min(1.0, worse)
    assume(worse != old)
    seen_worse = {**seen, target.instance: replace(before, **{field: worse})}
    # Same history for both: one round first, then the next round with the same or the worse signal.
    # (Without history, an all-stale cluster falls back to neutral weights, which may exceed a scored
    # weight; and health needs ``health_rounds`` rounds, so a second round may change another
    # endpoint's health and with it the pool every relative score is taken over.)
    _, state = compute_weights(endpoints, seen, EngineState(), p, plugins=BUILTIN)
    a, _ = compute_weights(endpoints, seen, state, p, plugins=BUILTIN)
    b, _ = compute_weights(endpoints, seen_worse, state, p, plugins=BUILTIN)
    idx = endpoints.index(target)
    assert effective(b[idx]) <= effective(a[idx]), (field, a[idx], b[idx])


@SETTINGS
@given(data=st.data(), endpoints=pools(), p=params)
def test_all_stale_keeps_the_last_weights(data, endpoints, p):
    first, state = compute_weights(endpoints, stats_for(data.draw, endpoints, missing_ok=False), EngineState(), p,
                                   plugins=BUILTIN)
    stale_age = st.none() | st.floats(min_value=p.stale_after_s, max_value=1e9, exclude_min=True)
    stale = {s.instance: replace(data.draw(endpoint_stats), sample_age_s=data.draw(stale_age))
             for s in endpoints if data.draw(st.booleans())}  # the others are missing: never seen
    second, state2 = compute_weights(endpoints, stale, state, p, plugins=BUILTIN)
    for s, w1, w2 in zip(endpoints, first, second, strict=True):
        assert w2.weight == w1.weight
        assert w2.health == (DRAINING if s.draining else HEALTHY)
    assert dict(state2.weights) == dict(state.weights)
