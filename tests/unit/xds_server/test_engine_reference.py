"""Differential test: the array-wise engine against the scalar engine it replaced (kept, for this
test only, in ``tests/support/reference_engine``): the same weights, health, scores, reasons, filter
verdicts and factors, round after round, for generated fleets and inputs."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.factories import spec
from tests.support.reference_engine.builtin import BUILTIN as REF_BUILTIN
from tests.support.reference_engine.pipeline import compute_weights as ref_compute_weights
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import EngineParams, EngineState
from xds_server.metrics.stats import EndpointStats

finite = st.floats(min_value=-10.0, max_value=5e3, allow_nan=False)
odd = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308])
value = st.none() | finite | odd | st.sampled_from([50.0, 100.0, 120.0, 900.0, 0.5, 1.0])


def stats_strategy():
    return st.builds(
        EndpointStats,
        latency_mean_ms=value, latency_p95_ms=value, queue=value, running=value, in_flight=value,
        gpu_util=st.none() | st.floats(0.0, 1.0) | odd, gpu_mem_free_mib=value | st.sampled_from([1000.0, 3e4]),
        gpu_mem_used_mib=value, kv_cache=st.none() | st.floats(0.0, 1.2), request_rate=value,
        error_rate=st.none() | st.floats(0.0, 0.5), success_total=value, oom_total=value,
        client_latency_mean_ms=st.none() | value, client_latency_p95_ms=st.none() | value,
        client_error_rate=st.none() | st.floats(0.0, 0.5),
        sample_age_s=st.none() | st.sampled_from([0.0, 1.0, 14.0, 16.0, 100.0]))


plugin_params = st.fixed_dictionaries({}, optional={
    "capacity": st.builds(REF_BUILTIN.factors["capacity"].params, mode=st.sampled_from(["configured", "measured"]),
                          warmup_s=st.sampled_from([1.0, 3.0])),
    "balance": st.builds(REF_BUILTIN.factors["balance"].params, min_rps=st.sampled_from([0.0, 1.0]),
                         step=st.sampled_from([0.02, 0.3])),
    "oom": st.builds(REF_BUILTIN.filters["oom"].params, consecutive=st.integers(1, 3)),
    "latency_outlier": st.builds(REF_BUILTIN.filters["latency_outlier"].params, min_hosts=st.integers(2, 4),
                                 min_delta_ms=st.sampled_from([0.0, 50.0]), signal=st.sampled_from(["p95", "mean"])),
    "slow_start": st.builds(REF_BUILTIN.factors["slow_start"].params, window_s=st.sampled_from([0.0, 2.0, 5.0]),
                            requests=st.sampled_from([0, 10])),
    "gpu_memory": st.builds(REF_BUILTIN.factors["gpu_memory"].params, rounds=st.integers(1, 2)),
    "max_concurrency": st.builds(REF_BUILTIN.factors["max_concurrency"].params, rounds=st.integers(1, 2)),
})

engine_params = st.builds(
    EngineParams,
    max_weight=st.sampled_from([1, 100, 10**6, 10**11]),
    hysteresis=st.sampled_from([0.0, 0.1, 0.5]),
    quantum=st.sampled_from([0.0, 0.01, 0.3]),
    max_change=st.none() | st.sampled_from([0.5, 1.0]),
    drain_timeout_s=st.sampled_from([1.0, 120.0]),
    health_rounds=st.integers(1, 3),
    disabled=st.frozensets(st.sampled_from(["gpu_memory", "max_concurrency", "oom", "latency_outlier", "capacity",
                                            "slow_start", "balance"])),
    scorer_weights=st.fixed_dictionaries({}, optional={n: st.sampled_from([0.0, 0.5, 2.0]) for n in BUILTIN.scorers}),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), p=engine_params, pp=plugin_params)
def test_the_array_engine_decides_as_the_scalar_engine_did(data, p, pp):
    p = replace(p, plugin_params={k: v for k, v in pp.items()})
    fleet = [spec(i, f"svc-v{c}", capacity=data.draw(st.sampled_from([0.5, 1.0, 2.0])),
                  gpu_class=data.draw(st.sampled_from(["a100", "a10"])),
                  max_concurrency=data.draw(st.integers(1, 20)))
             for c in range(data.draw(st.integers(1, 2))) for i in range(data.draw(st.integers(1, 12)))]
    new_state = ref_state = EngineState()
    now = 0.0
    for _ in range(data.draw(st.integers(1, 6))):
        specs = [replace(s, draining=data.draw(st.integers(0, 6)) == 0) for s in fleet]
        specs = [s for s in specs if data.draw(st.integers(0, 9)) > 0]  # some leave the config for a round
        seen = {s.instance: data.draw(stats_strategy()) for s in specs if data.draw(st.integers(0, 7)) > 0}
        got, new_state = compute_weights(specs, seen, new_state, p, now, plugins=BUILTIN)
        want, ref_state = ref_compute_weights(specs, seen, ref_state, p, now, plugins=REF_BUILTIN)
        for g, w in zip(got, want, strict=True):
            assert g == w, (g, w)
            assert list(g.filters.items()) == list(w.filters.items())
            assert list(g.scores.items()) == list(w.scores.items())
            assert list(g.factors.items()) == list(w.factors.items())
            assert type(g.weight) is int and (g.score is None or type(g.score) is float)
            for r in g.reasons:  # which rules the generated rounds reached (shown with --hypothesis-show-statistics)
                event(r.split(":")[0].split(" ")[0])
            for f, m in g.factors.items():
                if m != 1.0:
                    event(f"factor {f}")
        assert new_state.weights == ref_state.weights and new_state.eligible == ref_state.eligible
        now += data.draw(st.sampled_from([0.5, 1.0, 10.0, 60.0]))
