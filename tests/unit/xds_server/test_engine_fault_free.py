"""The real weight engine over 10 minutes of the demo's topology in virtual time: no ejection and no
health change without a fault (issue 39: a fault-free 240 s demo ejected its two loaded A100s 4
times), and a slow node among the same traffic still ejected.

Each round (1 s, the demo's loop) hands the engine what Prometheus gives over the demo's 10 s
window: per endpoint a batch (running requests) that wanders as sessions come and go (the A100s
busier than the A10s: they take more of the picker's traffic), queueing at the busiest moments,
end-to-end latency that follows the batch and long answers, and the inter-token latency of the
engine's decode step at that batch x the GPU class, with the noise of a 10 s window. Two kinds of
engine: the simulator's ``job`` engine (step proportional to the batch: ``sim.engines.job.decode_step_ms``)
and continuous batching (BLIS's A100 fit: 16.4 ms + 18.2 us per running request).
"""

from __future__ import annotations

import numpy as np
import pytest

from inferlb.demo import BACKENDS, demo_config
from xds_server.config import parse_config
from xds_server.control import endpoint_specs, engine_params
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.pipeline import compute_weights
from xds_server.engine.types import HEALTHY, EngineState
from xds_server.metrics.stats import EndpointStats

STEP_MS = {
    "job": lambda b: (50.0 + (b - 1) * 45.0 if b <= 2 else 95.0 + (b - 2) * 62.5) / 15 - 0.1,  # sim.engines.job
    "continuous": lambda b: 16.44 + 0.0182 * b,
}
CLASS_FACTOR = {"a100": 1.0, "a10": 2.5}
ROUNDS = 600


def _demo():
    import yaml

    backends = [(v, g, 9000 + i) for i, (v, g) in enumerate(BACKENDS)]
    cfg = parse_config(yaml.safe_dump(demo_config(backends)), "demo.yaml")
    return endpoint_specs(cfg), engine_params(cfg)


def _run(engine: str, seed: int, slow: tuple[int, float, float] | None = None):
    """The engine over :data:`ROUNDS` rounds; ``slow = (endpoint index, from round, ITL factor)``.
    Returns every round's ``{address: (health, reasons)}``."""
    specs, params = _demo()
    rng = np.random.default_rng(seed)
    step = STEP_MS[engine]
    busy = np.array([5.0 if s.gpu_class == "a100" else 1.5 for s in specs])  # where each batch hovers
    batch = busy.copy()
    state, seen_rounds = EngineState(), []
    for t in range(ROUNDS):
        batch = np.clip(batch + rng.normal(0, 0.6, len(specs)) + 0.1 * (busy - batch), 0.3, 8.0)
        stats = {}
        for i, s in enumerate(specs):
            b = float(batch[i])
            itl = step(max(b, 1.0)) * CLASS_FACTOR[s.gpu_class] * float(rng.lognormal(0, 0.15))
            if slow is not None and i == slow[0] and t >= slow[1]:
                itl *= slow[2]
            e2e = itl * float(rng.uniform(20, 200)) + (40.0 * (b - 6) if b > 6 else 0.0)
            stats[s.instance] = EndpointStats(
                latency_mean_ms=e2e, latency_p95_ms=e2e * float(rng.uniform(1.5, 4)), itl_mean_ms=itl,
                queue=max(0.0, b - 6.5), running=b, in_flight=b, gpu_util=min(1.0, 0.2 + b / 10),
                gpu_mem_free_mib=60000.0 - 2000 * b, gpu_mem_used_mib=20000.0 + 2000 * b, kv_cache=b / 10,
                request_rate=b * 1000 / e2e, error_rate=0.0, success_total=10.0 * t, oom_total=0.0,
                sample_age_s=1.0)
        weights, state = compute_weights(specs, stats, state, params, now=float(t), plugins=BUILTIN)
        seen_rounds.append({w.address: (w.health, w.reasons) for w in weights})
    return specs, seen_rounds


@pytest.mark.parametrize("engine", sorted(STEP_MS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ten_fault_free_minutes_of_the_demo_topology_eject_nothing(engine, seed):
    specs, rounds = _run(engine, seed)
    changes = [(t, a, h, r) for t, seen in enumerate(rounds) for a, (h, r) in seen.items() if h != HEALTHY]
    assert changes == [], changes[:3]


@pytest.mark.parametrize("engine", sorted(STEP_MS))
def test_a_slow_a100_among_the_same_traffic_is_ejected(engine):
    """From round 300 every token of the first A100 takes 5.5x (the simulator's long_tail at 0.5)."""
    specs, rounds = _run(engine, 1, slow=(0, 300, 5.5))
    slow = specs[0].address
    assert all(seen[slow][0] == HEALTHY for seen in rounds[:300])
    ejected = [t for t, seen in enumerate(rounds) if seen[slow][0] != HEALTHY]
    assert ejected and ejected[0] <= 305, ejected[:5]
    assert any("latency_outlier: latency outlier: inter-token latency" in r for r in rounds[ejected[0] - 1][slow][1])
    others = {s.address for s in specs[1:]}
    assert all(seen[a][0] == HEALTHY for seen in rounds for a in others)
