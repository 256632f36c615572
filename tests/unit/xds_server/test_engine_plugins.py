"""The engine's plugins one by one (through the pipeline, as they run), drain (C11), stability and
the explanation every endpoint carries."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.support.factories import config, same_stats, score, spec, specs, stats
from xds_server.config import ConfigError
from xds_server.control import engine_params
from xds_server.engine import stability
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.ejection import max_ejected
from xds_server.engine.factors import balance, capacity, slow_start
from xds_server.engine.filters import latency_outlier, oom
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EngineParams, EngineState

# health_rounds=1: these tests are about each plugin's own rule; the pipeline's health hysteresis
# (health_rounds, default 2) is tested in test_engine.py.
BASE = EngineParams(hysteresis=0.0, max_change=None, health_rounds=1)
OK = {"gpu_util": 0.3, "running": 1.0, "queue": 0.0, "latency_mean_ms": 50.0, "latency_p95_ms": 80.0,
      "itl_mean_ms": 3.0}


def with_plugins(params: EngineParams = BASE, **plugins) -> EngineParams:
    return replace(params, plugin_params={**params.plugin_params, **plugins})


class Rounds:
    """Runs the engine round after round on one clock, keeping its state."""

    def __init__(self, endpoints, params=BASE):
        self.eps, self.params, self.state, self.now = endpoints, params, EngineState(), 0.0

    def run(self, seen, at=None):
        self.now = self.now if at is None else at
        weights, self.state = compute_weights(self.eps, seen, self.state, self.params, now=self.now, plugins=BUILTIN)
        return {w.address: w for w in weights}


def healthy(out) -> set[str]:
    return {a for a, w in out.items() if w.health == HEALTHY}


# --- latency outlier ejection ----------------------------------------------------------------------


def long_tail(eps, bad: int, itl: float = 18.0):
    """Every endpoint at 1 running with a 3 ms step, ``bad`` with an ITL of ``itl`` ms at the same load."""
    seen = same_stats(eps, **OK)
    seen[eps[bad].instance] = stats(**{**OK, "itl_mean_ms": itl})
    return seen


def test_a_long_tail_endpoint_is_ejected_and_comes_back_after_it_recovers():
    eps = specs(4)
    params = with_plugins(latency_outlier=latency_outlier.Params(base_ejection_s=10))
    r = Rounds(eps, params)
    out = r.run(long_tail(eps, 0), at=0)
    assert healthy(out) == {e.address for e in eps[1:]}
    why = out[eps[0].address].reasons[0]
    assert why.startswith("latency_outlier: latency outlier: inter-token latency 18 ms > 3 x the 3 ms its peers "
                          "take at its load (1.0 running)"), why
    assert "ejected for 10 s (ejection #1)" in why
    assert out[eps[0].address].filters["latency_outlier"].startswith("latency outlier")
    assert r.run(same_stats(eps, **OK), at=5)[eps[0].address].health == UNHEALTHY  # recovered, but still out
    assert r.run(same_stats(eps, **OK), at=10)[eps[0].address].health == HEALTHY  # ejection over


def test_ejection_time_grows_with_repeats_and_is_capped():
    eps = specs(4)
    params = with_plugins(latency_outlier=latency_outlier.Params(base_ejection_s=10, max_ejection_s=25))
    r = Rounds(eps, params)
    bad = long_tail(eps, 0)
    assert "for 10 s (ejection #1)" in r.run(bad, at=0)[eps[0].address].reasons[0]
    assert "for 20 s (ejection #2)" in r.run(bad, at=10)[eps[0].address].reasons[0]
    assert r.run(bad, at=29)[eps[0].address].health == UNHEALTHY
    assert "for 25 s (ejection #3)" in r.run(bad, at=30)[eps[0].address].reasons[0]  # capped


def test_the_multiplier_decays_while_the_endpoint_behaves():
    eps = specs(4)
    params = with_plugins(latency_outlier=latency_outlier.Params(base_ejection_s=10))
    r = Rounds(eps, params)
    bad, good = long_tail(eps, 0), same_stats(eps, **OK)
    r.run(bad, at=0)
    r.run(good, at=10)  # back; calm from now on
    r.run(good, at=20)  # one base period calm: multiplier 1 -> 0
    assert "(ejection #1)" in r.run(bad, at=21)[eps[0].address].reasons[0]


@pytest.mark.parametrize(("pool", "percent", "expected"), [(1, 30, 0), (2, 30, 1), (4, 30, 1), (10, 30, 3),
                                                           (4, 100, 3), (4, 0, 1)])
def test_max_ejected_is_a_share_of_the_pool_but_at_least_one_and_never_all(pool, percent, expected):
    assert max_ejected(pool, percent) == expected


def test_at_most_max_ejection_percent_of_the_pool_is_ejected_the_worst_first():
    eps = specs(7)
    seen = same_stats(eps, **OK)
    for i, itl in ((0, 12.0), (1, 40.0), (2, 20.0)):
        seen[eps[i].instance] = stats(**{**OK, "itl_mean_ms": itl})
    out = Rounds(eps).run(seen)  # 30 % of 7 -> 2
    assert {a for a, w in out.items() if w.health == UNHEALTHY} == {eps[1].address, eps[2].address}


def test_an_a10_as_slow_as_an_a10_should_be_is_not_an_outlier():
    eps = [spec(0), spec(1), spec(2, gpu_class="a10", capacity=0.4)]
    seen = same_stats(eps, **OK)
    seen[eps[2].instance] = stats(**{**OK, "itl_mean_ms": 3.0 * 2.5 * 1.2})
    assert healthy(Rounds(eps).run(seen)) == {e.address for e in eps}
    raw = with_plugins(latency_outlier=latency_outlier.Params(normalize_by_capacity=False, factor=2))
    assert eps[2].address not in healthy(Rounds(eps, raw).run(seen))


# Decode step (ms) at a batch of b running requests, two kinds of engine: the simulator's ``job``
# engine (saturated: sim.engines.job.decode_step_ms, 3.2 ms at 1, 31 ms at 8) and continuous batching
# (BLIS's A100 fit: 16.4 ms + 18.2 us per running request), and llm-d's inference simulator's load
# factor near max_num_seqs (3.5x at 8 running of 8).
ENGINES = {
    "job": lambda b: (50.0 + (b - 1) * 45.0 if b <= 2 else 95.0 + (b - 2) * 62.5) / 15 - 0.1,
    "continuous": lambda b: 16.44 + 0.0182 * b,
    "load-factor": lambda b: 10.0 * (1 + 2.5 * (b - 1) / 7),
}


def _seen(eps, step, running, slow=None, k=1.0):
    """Stats at ``running[i]`` requests each: ITL = the engine's step at that batch (x 2.5 on an A10),
    ``k`` x on endpoint ``slow``."""
    return {e.instance: stats(**{**OK, "running": running[i], "latency_p95_ms": 80.0 * running[i],
                                 "itl_mean_ms": step(running[i]) * (2.5 if e.gpu_class == "a10" else 1.0)
                                 * (k if i == slow else 1.0)})
            for i, e in enumerate(eps)}


def _learned(eps, step, rounds=40):
    """The engine after ``rounds`` rounds (1 s apart) in which every endpoint's batch moved (1-8)."""
    r = Rounds(eps)
    for t in range(rounds):
        assert healthy(r.run(_seen(eps, step, [1.0 + (t * (3 + i)) % 8 for i in range(len(eps))]), at=t)) \
            == {e.address for e in eps}
    return r


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_loaded_endpoint_is_not_an_outlier_next_to_idle_peers_whatever_the_engine(engine):
    """The fault-free demo's trap (issue 39): the most loaded A100s were ejected for latency that load
    raises on any GPU. At its own batch an endpoint's step is like its peers', however busy it is:
    from the first round (the bound) and once the curve is learned."""
    step = ENGINES[engine]
    eps = [spec(0), spec(1), spec(2, gpu_class="a10", capacity=0.4), spec(3)]
    running = [8.0, 6.0, 2.0, 1.0]
    assert healthy(Rounds(eps).run(_seen(eps, step, running))) == {e.address for e in eps}
    r = _learned(eps, step)
    assert healthy(r.run(_seen(eps, step, running), at=40)) == {e.address for e in eps}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_once_the_curve_is_learned_a_slow_endpoint_is_an_outlier_at_any_load(engine):
    """Every token 5.5x slower (the simulator's long_tail at 0.5), at a batch from 1/4 to 2x its peers'."""
    step = ENGINES[engine]
    eps = specs(4)
    for slow_running in (1.0, 4.0, 8.0):
        r = _learned(eps, step)
        out = r.run(_seen(eps, step, [slow_running, 4.0, 4.0, 4.0], slow=0, k=5.5), at=40)
        assert healthy(out) == {e.address for e in eps[1:]}, (engine, slow_running)
        assert "ITL ~ running^" in out[eps[0].address].reasons[0]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_before_the_curve_is_learned_the_bound_still_finds_a_slow_endpoint_near_its_peers_load(engine):
    step = ENGINES[engine]
    eps = specs(4)
    for slow_running in (3.0, 4.0, 5.0):
        out = Rounds(eps).run(_seen(eps, step, [slow_running, 4.0, 4.0, 4.0], slow=0, k=10.0))
        assert healthy(out) == {e.address for e in eps[1:]}, (engine, slow_running)


def test_the_curve_is_learned_within_each_endpoint_so_a_slow_one_does_not_bend_it():
    """α from how each endpoint's own ITL moved with its own batch: ~1 for the saturated engine, ~0
    for continuous batching, whatever constant factor one endpoint carries."""
    for engine, expected in (("job", 1.0), ("continuous", 0.0)):
        eps = specs(4)
        r = Rounds(eps, with_plugins(latency_outlier=latency_outlier.Params(factor=100)))  # nobody ejected
        for t in range(40):
            r.run(_seen(eps, ENGINES[engine], [1.0 + (t * (3 + i)) % 8 for i in range(4)], slow=0, k=5.0), at=t)
        records = r.state.plugins["c"]["latency_outlier"]
        alpha = latency_outlier.curve(records, [e.address for e in eps], 0.15)
        assert alpha == pytest.approx(expected, abs=0.08), engine
    assert latency_outlier.curve(records, [], 0.15) is None


def test_small_absolute_differences_and_quiet_endpoints_are_not_judged():
    eps = specs(3)
    seen = same_stats(eps, **{**OK, "itl_mean_ms": 0.1})
    seen[eps[0].instance] = stats(**{**OK, "itl_mean_ms": 0.9})  # 9x, but only 0.8 ms more
    assert len(healthy(Rounds(eps).run(seen))) == 3
    quiet = with_plugins(latency_outlier=latency_outlier.Params(min_request_rate=1.0))
    seen = long_tail(eps, 0)
    seen[eps[0].instance] = replace(seen[eps[0].instance], request_rate=0.2)
    assert len(healthy(Rounds(eps, quiet).run(seen))) == 3
    seen = long_tail(eps, 0)
    seen[eps[0].instance] = replace(seen[eps[0].instance], itl_mean_ms=None)  # no ITL (Triton): not judged
    assert len(healthy(Rounds(eps).run(seen))) == 3


def test_a_pool_below_min_hosts_is_not_judged():
    """Two endpoints: the busier one is not an outlier of a median of one (the versions scenario's trap)."""
    eps = specs(2)
    assert len(healthy(Rounds(eps).run(long_tail(eps, 0)))) == 2
    two = with_plugins(latency_outlier=latency_outlier.Params(min_hosts=2))
    assert healthy(Rounds(eps, two).run(long_tail(eps, 0))) == {eps[1].address}
    eps = specs(3)
    assert healthy(Rounds(eps).run(long_tail(eps, 0))) == {e.address for e in eps[1:]}  # 3 = the default floor


def test_with_tiers_an_endpoint_is_judged_among_its_own_tier():
    """A slow node is an outlier among its own tier, and an edge is judged by the edge's steps."""
    edge = [spec(i, gpu_class="a10", capacity=0.4) for i in range(3)]
    cloud = [spec(i, tier="cloud") for i in range(3, 6)]
    eps = edge + cloud
    seen = same_stats(eps, **OK)
    for e in edge:  # an A10's step, at 4 running
        seen[e.instance] = stats(**{**OK, "running": 4.0, "itl_mean_ms": 3.0 * 2.5 * 4})
    assert healthy(Rounds(eps).run(seen)) == {e.address for e in eps}
    seen[edge[0].instance] = stats(**{**OK, "running": 4.0, "itl_mean_ms": 300.0})
    out = Rounds(eps).run(seen)
    assert healthy(out) == {e.address for e in eps[1:]}
    assert out[edge[0].address].reasons[0].startswith(
        "latency_outlier: latency outlier: inter-token latency 120 ms > 3 x the 12 ms its peers take at its load "
        "(4.0 running) (capacity-normalised) among the edge tier"), out[edge[0].address].reasons[0]


# --- OOM ejection ---------------------------------------------------------------------------------


def test_consecutive_ooms_eject_and_a_success_resets_the_streak():
    eps = specs(4)
    params = with_plugins(oom=oom.Params(consecutive=3, base_ejection_s=10))
    r = Rounds(eps, params)

    def seen(ooms, successes):
        s = same_stats(eps, **OK, oom_total=0.0, success_total=100.0)
        s[eps[0].instance] = stats(**OK, oom_total=ooms, success_total=successes)
        return s

    assert eps[0].address in healthy(r.run(seen(0, 10), at=0))
    assert eps[0].address in healthy(r.run(seen(2, 10), at=1))  # streak 2
    assert eps[0].address in healthy(r.run(seen(4, 11), at=2))  # a success: reset
    assert eps[0].address in healthy(r.run(seen(6, 11), at=3))  # streak 2
    out = r.run(seen(7, 11), at=4)  # streak 3
    assert out[eps[0].address].health == UNHEALTHY
    assert "3 consecutive out-of-memory refusals; ejected for 10 s" in out[eps[0].address].reasons[0]
    assert r.run(seen(7, 11), at=13)[eps[0].address].health == UNHEALTHY
    assert r.run(seen(7, 11), at=14)[eps[0].address].health == HEALTHY


def test_an_endpoint_removed_from_the_config_forgets_its_state_and_the_others_keep_theirs():
    eps = specs(4)
    params = with_plugins(oom=oom.Params(consecutive=3, base_ejection_s=10))
    r = Rounds(eps, params)

    def seen(ooms):
        s = same_stats(r.eps, **OK, oom_total=0.0, success_total=100.0)
        for e in r.eps[:2]:  # eps[0] and eps[1] refuse requests (no success)
            s[e.instance] = stats(**OK, oom_total=ooms, success_total=100.0)
        return s

    r.run(seen(0), at=0)
    r.run(seen(2), at=1)  # streak 2 on both
    r.eps = [eps[0], *eps[2:]]  # eps[1] leaves the config
    r.run(seen(2), at=2)  # same addresses as the next round: their states are passed on as they are
    assert eps[1].address not in r.state.plugins["c"]["oom"]
    r.eps = eps  # and comes back: it starts over
    out = r.run(seen(3), at=3)
    assert out[eps[0].address].health == UNHEALTHY, "its streak reached 3"
    assert out[eps[1].address].health == HEALTHY, "its old streak was forgotten"


def test_a_counter_reset_is_a_restart_not_a_negative_count():
    eps = specs(3)
    r = Rounds(eps, with_plugins(oom=oom.Params(consecutive=2)))
    base = same_stats(eps, **OK, oom_total=0.0, success_total=0.0)
    r.run({**base, eps[0].instance: stats(**OK, oom_total=50.0, success_total=9.0)}, at=0)
    out = r.run({**base, eps[0].instance: stats(**OK, oom_total=2.0, success_total=0.0)}, at=1)  # restarted
    assert out[eps[0].address].health == UNHEALTHY


# --- slow start -----------------------------------------------------------------------------------


def test_endpoints_of_the_first_round_start_at_full_weight_and_a_new_one_ramps():
    eps = specs(3)
    params = with_plugins(slow_start=slow_start.Params(window_s=20, min_weight_percent=10))
    r = Rounds(eps[:2], params)
    first = r.run(same_stats(eps, **OK), at=0)
    full = first[eps[0].address].weight
    assert all(w.factors["slow_start"] == 1.0 for w in first.values())
    r.eps = eps  # scale-up: a third endpoint joins
    ramp = [r.run(same_stats(eps, **OK), at=t)[eps[2].address] for t in (0, 5, 10, 15, 20, 25)]
    assert [w.factors["slow_start"] for w in ramp] == pytest.approx([0.1, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert [w.weight for w in ramp] == [round(full * f) for f in (0.1, 0.25, 0.5, 0.75, 1.0, 1.0)]


def test_slow_start_ends_after_k_successful_requests():
    eps = specs(2)
    params = with_plugins(slow_start=slow_start.Params(window_s=100, requests=50))
    r = Rounds(eps[:1], params)
    r.run(same_stats(eps, **OK), at=0)
    r.eps = eps
    seen = same_stats(eps, **OK, success_total=1000.0)
    assert r.run(seen, at=1)[eps[1].address].factors["slow_start"] == pytest.approx(0.1)
    seen[eps[1].instance] = stats(**OK, success_total=1049.0)
    assert r.run(seen, at=2)[eps[1].address].factors["slow_start"] < 1.0
    seen[eps[1].instance] = stats(**OK, success_total=1050.0)
    assert r.run(seen, at=3)[eps[1].address].factors["slow_start"] == 1.0


def test_aggression_shapes_the_ramp():
    p = slow_start.Params(window_s=10, aggression=2.0, min_weight_percent=1)
    eps = specs(2)
    r = Rounds(eps[:1], with_plugins(slow_start=p))
    r.run(same_stats(eps, **OK), at=0)
    r.eps = eps
    r.run(same_stats(eps, **OK), at=0)
    assert r.run(same_stats(eps, **OK), at=2.5)[eps[1].address].factors["slow_start"] == pytest.approx(0.5)


def test_an_endpoint_back_from_exclusion_ramps_again():
    eps = specs(3)
    r = Rounds(eps, with_plugins(slow_start=slow_start.Params(window_s=10)))
    r.run(same_stats(eps, **OK), at=0)
    seen = same_stats(eps, **OK)
    seen[eps[0].instance] = stats(**OK, sample_age_s=60.0)
    assert r.run(seen, at=1)[eps[0].address].health == UNHEALTHY
    back = r.run(same_stats(eps, **OK), at=2)[eps[0].address]
    assert back.health == HEALTHY and back.factors["slow_start"] == pytest.approx(0.1)


# --- balance correction ---------------------------------------------------------------------------


def test_balance_nudges_shares_toward_the_targets_and_is_bounded():
    eps = specs(2)
    params = with_plugins(balance=balance.Params(step=0.1, max_factor=1.5))
    r = Rounds(eps, params)
    seen = same_stats(eps, **OK)
    seen[eps[0].instance] = stats(**OK, request_rate=9.0)  # equal targets, 90 % of the requests
    seen[eps[1].instance] = stats(**OK, request_rate=1.0)
    out = r.run(seen)
    assert out[eps[0].address].factors["balance"] == pytest.approx(math.exp(-0.1))
    assert out[eps[1].address].factors["balance"] == pytest.approx(math.exp(0.1))
    for _ in range(20):
        out = r.run(seen)
    assert out[eps[0].address].factors["balance"] == pytest.approx(1 / 1.5)
    assert out[eps[1].address].factors["balance"] == pytest.approx(1.5)


def test_balance_is_inert_without_traffic_or_inside_the_dead_band():
    eps = specs(2)
    seen = same_stats(eps, **OK, request_rate=0.1)  # 0.2 req/s in total < min_rps 1
    assert {w.factors["balance"] for w in Rounds(eps).run(seen).values()} == {1.0}
    seen = {eps[0].instance: stats(**OK, request_rate=10.4), eps[1].instance: stats(**OK, request_rate=9.6)}
    assert {w.factors["balance"] for w in Rounds(eps).run(seen).values()} == {1.0}
    seen = {eps[0].instance: stats(**OK, request_rate=10.0), eps[1].instance: stats(**OK)}  # one rate unknown
    assert {w.factors["balance"] for w in Rounds(eps).run(seen).values()} == {1.0}


def test_balance_targets_follow_capacity():
    eps = [spec(0), spec(1, gpu_class="a10", capacity=0.4)]
    seen = {eps[0].instance: stats(**OK, request_rate=5.0), eps[1].instance: stats(**OK, request_rate=5.0)}
    out = Rounds(eps).run(seen)  # the A10 should take 0.4/1.4 of the requests, takes half
    assert out[eps[1].address].factors["balance"] < 1.0 < out[eps[0].address].factors["balance"]


# --- capacity -------------------------------------------------------------------------------------


def test_capacity_is_configured_per_gpu_class_by_default():
    eps = [spec(0), spec(1, gpu_class="h100", capacity=1.6)]
    out = Rounds(eps).run(same_stats(eps, **OK))
    assert out[eps[1].address].factors["capacity"] == 1.6


def test_capacity_measured_at_warm_up():
    eps = [spec(0), spec(1), spec(2, gpu_class="a10", capacity=0.4)]
    r = Rounds(eps, with_plugins(capacity=capacity.Params(mode="measured", warmup_s=10)))
    lat = {0: 50.0, 1: 54.0, 2: 200.0}  # the A10 is 3.85x slower here, not the configured 2.5x
    seen = {e.instance: stats(**{**OK, "latency_mean_ms": lat[i]}) for i, e in enumerate(eps)}
    out = r.run(seen, at=0)
    assert out[eps[2].address].factors["capacity"] == 0.4  # not measured yet
    r.run(seen, at=5)
    out = r.run(seen, at=10)
    assert out[eps[2].address].factors["capacity"] == pytest.approx(52.0 / 200.0)
    assert out[eps[0].address].factors["capacity"] == pytest.approx(1.0)
    slower = {e.instance: stats(**{**OK, "latency_mean_ms": 500.0}) for e in eps}
    assert r.run(slower, at=20)[eps[2].address].factors["capacity"] == pytest.approx(52.0 / 200.0)  # fixed


# --- the other scorers ----------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "expected"), [(0.0, 1.0), (8.0, 0.5), (24.0, 0.25), (None, None), (-3.0, 1.0)])
def test_queue_scorer(queue, expected):
    got = score("queue", spec(0, max_concurrency=8), stats(queue=queue))
    assert got == (None if expected is None else pytest.approx(expected))
    assert score("queue", spec(0), stats(queue=2.0), half_at=2.0) == pytest.approx(0.5)


def test_memory_scorer_is_headroom_beyond_one_request():
    s = spec(0, memory_mib=10000.0)  # need 2048 x 1.2 = 2457.6 MiB
    assert score("memory", s, stats(gpu_mem_free_mib=10000.0)) == pytest.approx(1.0)
    assert score("memory", s, stats(gpu_mem_free_mib=2457.6)) == pytest.approx(0.0)
    assert score("memory", s, stats(gpu_mem_free_mib=1000.0)) == 0.0
    assert score("memory", s, stats(gpu_mem_used_mib=7542.4 / 2)) == pytest.approx(0.5)  # free = total - used
    assert score("memory", s, stats()) is None


def test_kv_cache_and_errors_scorers():
    assert score("kv_cache", spec(0), stats(kv_cache=0.8)) == pytest.approx(0.2)
    assert score("errors", spec(0), stats(error_rate=0.05)) == pytest.approx(0.75)
    assert score("errors", spec(0), stats(error_rate=0.05, client_error_rate=0.1)) == pytest.approx(0.5)
    assert score("errors", spec(0), stats(error_rate=0.5)) == 0.0
    assert score("errors", spec(0), stats()) is None


# --- drain (C11) ----------------------------------------------------------------------------------


def test_a_draining_endpoint_is_draining_at_once_and_removed_when_nothing_is_in_flight():
    eps = specs(3)
    r = Rounds(eps, replace(BASE, drain_timeout_s=60))
    before = r.run(same_stats(eps, **OK, in_flight=2.0), at=0)
    r.eps = [eps[0], eps[1], replace(eps[2], draining=True)]
    out = r.run(same_stats(eps, **OK, in_flight=2.0), at=1)
    d = out[eps[2].address]
    assert (d.health, d.removed, d.weight) == (DRAINING, False, before[eps[2].address].weight)
    assert d.reasons[0] == "draining: no new requests; 2 in flight (0 of 60 s)"
    seen = same_stats(eps, **OK, in_flight=2.0)
    seen[eps[2].instance] = stats(**OK, in_flight=0.0)
    d = r.run(seen, at=5)[eps[2].address]
    assert d.removed and d.health == DRAINING and "no request in flight after 4 s" in d.reasons[0]


def test_only_a_sample_taken_after_the_drain_began_can_show_it_idle():
    """The sample of the drain's first round predates it: requests sent until Envoy had the drain are
    not in it (a user trial: removed at 0.2 s with 14 running)."""
    eps = specs(2)
    r = Rounds(eps, replace(BASE, drain_timeout_s=60))
    r.run(same_stats(eps, **OK, in_flight=0.0), at=0)
    r.eps = [eps[0], replace(eps[1], draining=True)]
    idle = same_stats(eps, **OK, in_flight=0.0)   # sample_age_s 1: taken 1 s before each round
    assert not r.run(idle, at=10)[eps[1].address].removed      # taken at 9, the drain began at 10
    assert not r.run(idle, at=11)[eps[1].address].removed      # taken at 10: not after it
    assert r.run(idle, at=11.5)[eps[1].address].removed         # taken at 10.5


def test_a_drain_ends_at_the_timeout_even_with_requests_in_flight():
    eps = specs(2)
    r = Rounds([eps[0], replace(eps[1], draining=True)], replace(BASE, drain_timeout_s=30))
    seen = same_stats(eps, **OK, in_flight=5.0)
    assert not r.run(seen, at=0)[eps[1].address].removed
    assert not r.run(seen, at=29)[eps[1].address].removed
    assert r.run(seen, at=30)[eps[1].address].removed


def test_a_stale_or_unknown_in_flight_count_never_removes_early():
    eps = specs(2)
    r = Rounds([eps[0], replace(eps[1], draining=True)])
    seen = same_stats(eps, **OK)
    seen[eps[1].instance] = stats(in_flight=0.0, sample_age_s=99.0)
    assert not r.run(seen, at=1)[eps[1].address].removed
    seen[eps[1].instance] = stats(running=2.0)  # no in-flight count: the window average must reach 0
    assert not r.run(seen, at=2)[eps[1].address].removed
    seen[eps[1].instance] = stats(running=0.0, queue=0.0)
    assert r.run(seen, at=3)[eps[1].address].removed


def test_cancelling_a_drain_forgets_when_it_started():
    eps = specs(2)
    r = Rounds([eps[0], replace(eps[1], draining=True)], replace(BASE, drain_timeout_s=10))
    seen = same_stats(eps, **OK, in_flight=1.0)
    r.run(seen, at=0)
    r.eps = eps
    assert r.run(seen, at=5)[eps[1].address].health == HEALTHY
    r.eps = [eps[0], replace(eps[1], draining=True)]
    assert not r.run(seen, at=12)[eps[1].address].removed  # a new drain, a new timeout


# --- stability ------------------------------------------------------------------------------------


def test_bound_and_quantize():
    assert stability.bound(100, 500.0, 1.0) == 200.0
    assert stability.bound(100, 10.0, 0.5) == pytest.approx(100 / 1.5)
    assert stability.quantize(74.9, 1) == 75 and stability.quantize(75.0, 2) == 76
    assert stability.quantize(0.2, 5) == 5


def test_a_weight_moves_at_most_by_max_change_per_round():
    eps = specs(2)
    r = Rounds(eps, replace(BASE, max_change=0.5))
    r.run(same_stats(eps, gpu_util=0.0))  # 100 each
    out = r.run({eps[0].instance: stats(gpu_util=1.0), eps[1].instance: stats(gpu_util=0.0)})
    w = out[eps[0].address]
    assert w.target == 1 and w.weight == 67 and any("bounded to 67" in x for x in w.reasons)


def test_quantum_snaps_weights_to_steps():
    eps = specs(1)
    out = Rounds(eps, replace(BASE, quantum=0.1)).run(same_stats(eps, gpu_util=0.26))
    assert out[eps[0].address].weight == 70  # 74 -> step 10


# --- explanation and configuration ------------------------------------------------------------------


def test_every_endpoint_says_what_each_plugin_decided():
    eps = specs(3)
    seen = same_stats(eps, **OK)
    seen[eps[1].instance] = stats(**OK, gpu_mem_free_mib=10.0)
    seen[eps[2].instance] = stats(**OK, sample_age_s=99.0)
    out = Rounds(eps, replace(BASE, disabled=frozenset({"oom"}))).run(seen)
    ok, oomy, stale = (out[e.address] for e in eps)
    assert dict(ok.filters) == {"oom": "off", "latency_outlier": "pass"}
    assert set(ok.scores) == set(BUILTIN.scorers) and set(ok.factors) == set(BUILTIN.factors)
    assert ok.reasons[0] == f"score {ok.score:.2f} x max_weight 100 -> {ok.target}"
    assert oomy.health == HEALTHY and oomy.filters["latency_outlier"] == "pass"  # short of memory is not health
    assert oomy.factors["gpu_memory"] == 1.0  # one round short: no derating yet
    assert set(stale.filters.values()) <= {"not run", "off"}


def test_plugins_are_configured_in_yaml():
    cfg = config(engine={"filters": {"oom": False, "latency_outlier": {"factor": 2, "base_ejection_s": 5}},
                         "scorers": {"kv_cache": 0, "queue": {"weight": 2, "half_at": 3}},
                         "factors": {"balance": False, "slow_start": {"window_s": 60}},
                         "quantum": 0.05, "max_change": None, "drain_timeout_s": 30})
    p = engine_params(cfg)
    assert p.disabled == {"oom", "balance"}
    assert p.plugin_params["latency_outlier"].factor == 2 and p.plugin_params["latency_outlier"].base_ejection_s == 5
    assert p.scorer_weights["kv_cache"] == 0 and p.scorer_weights["queue"] == 2
    assert p.plugin_params["queue"].half_at == 3 and p.plugin_params["slow_start"].window_s == 60
    assert (p.quantum, p.max_change, p.drain_timeout_s) == (0.05, None, 30)


@pytest.mark.parametrize(("engine", "message"), [
    ({"filters": {"nope": {}}}, "unknown filter 'nope'; known: ["),
    ({"filters": {"latency_outlier": {"factor": 0.5}}}, "filters.latency_outlier: factor: Input should be greater"),
    ({"filters": {"latency_outlier": {"typo": 1}}}, "filters.latency_outlier: typo: Extra inputs are not permitted"),
    ({"filters": {"oom": 3}}, "filters.oom: expected a mapping of parameters, true or false"),
    ({"scorers": {"latency": -1}}, "scorers.latency: the weight must be a number >= 0"),
    ({"scorers": {"queue": {"weight": 1, "half_at": 0}}}, "scorers.queue: half_at: Input should be greater than 0"),
    ({"factors": {"slow_start": {"aggression": 0}}}, "factors.slow_start: aggression"),
    ({"factors": {"capacity": {"mode": "guess"}}}, "factors.capacity: mode"),
])
def test_bad_plugin_config_names_the_plugin_and_parameter(engine, message):
    with pytest.raises(ConfigError) as info:
        config(engine=engine)
    assert message in str(info.value)


def test_every_registered_plugin_has_documented_defaults():
    for table in (BUILTIN.filters, BUILTIN.scorers, BUILTIN.factors):
        for name, p in table.items():
            p.params()  # defaults valid
            assert name and p.run.__module__.startswith("xds_server.engine")


@pytest.mark.parametrize("name", ["gpu_memory", "max_concurrency"])
def test_the_saturation_filters_moved_to_factors_with_a_message(name):
    with pytest.raises(ConfigError, match=f"filters.{name} is now engine.factors.{name}"):
        config(engine={"filters": {name: False}})
    p = engine_params(config(engine={"factors": {name: {"rounds": 5, "penalty": 0.25}}, "health_rounds": 3}))
    assert p.plugin_params[name].rounds == 5 and p.plugin_params[name].penalty == 0.25 and p.health_rounds == 3


def test_balance_is_off_unless_the_config_names_it():
    assert "balance" in engine_params(config()).disabled
    assert "balance" not in engine_params(config(engine={"factors": {"balance": True}})).disabled
    assert "balance" not in engine_params(config(engine={"factors": {"balance": {"step": 0.05}}})).disabled


def test_a_drained_and_removed_endpoint_stays_removed_until_undrained():
    """Issue 15 item 2: in flight 0 -> removed; 2 -> still removed; stale -> still removed."""
    eps = specs(2)
    drained = [eps[0], replace(eps[1], draining=True)]
    r = Rounds(drained, replace(BASE, drain_timeout_s=60))
    seen = same_stats(eps, **OK, in_flight=0.0)
    assert not r.run(seen, at=0)[eps[1].address].removed  # its sample predates the drain
    assert r.run(seen, at=2)[eps[1].address].removed
    seen[eps[1].instance] = stats(**OK, in_flight=2.0)
    d = r.run(seen, at=3)[eps[1].address]
    assert d.removed and d.health == DRAINING and "no request in flight" in d.reasons[0]
    seen[eps[1].instance] = stats(**OK, in_flight=0.0)
    assert r.run(seen, at=4)[eps[1].address].removed
    seen[eps[1].instance] = stats(in_flight=3.0, sample_age_s=99.0)
    assert r.run(seen, at=5)[eps[1].address].removed
    r.eps = eps  # undrained: back, HEALTHY
    assert r.run(same_stats(eps, **OK, in_flight=3.0), at=6)[eps[1].address].health == HEALTHY
    r.eps = drained  # a new drain is decided afresh
    assert not r.run(same_stats(eps, **OK, in_flight=3.0), at=7)[eps[1].address].removed


def test_a_removed_endpoint_dropped_from_the_config_and_re_added_is_decided_afresh():
    eps = specs(2)
    drained = [eps[0], replace(eps[1], draining=True)]
    r = Rounds(drained, replace(BASE, drain_timeout_s=60))
    r.run(same_stats(eps, **OK, in_flight=0.0), at=0)
    assert r.run(same_stats(eps, **OK, in_flight=0.0), at=2)[eps[1].address].removed
    r.eps = [eps[0]]
    r.run(same_stats(eps, **OK), at=3)
    r.eps = drained
    assert not r.run(same_stats(eps, **OK, in_flight=2.0), at=4)[eps[1].address].removed
