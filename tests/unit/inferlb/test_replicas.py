"""Two control-plane replicas (two in-process inferlb instances) given the same inputs push identical
resources (same snapshot version, so the same weights and health) and pin every session to the same
endpoint, so an Envoy may talk to either and a client may land on either Envoy.

Same inputs = same config and the same stats in the same order of rounds (the engine's hysteresis
remembers the last weights: a replica that started later may hold a weight the other moved).
"""

from __future__ import annotations

import pytest

from ext_proc.picker import pick
from inferlb.serve import InferLB
from tests.support.factories import metrics_source
from xds_server.config import parse_config
from xds_server.metrics.stats import EndpointStats

CONFIG = """
listen: {xds: "127.0.0.1:0", ext_proc: "127.0.0.1:0", admin: "127.0.0.1:0"}
envoy: {ext_proc_address: "10.0.0.100:18080"}   # Envoy dials the picker through one Service address
prometheus: {first_round_wait_s: 0}
history: {path: ":memory:"}
services:
  - name: chat
    versions:
      - name: v1
        endpoints:
          - {address: 10.0.0.1:8000, gpu_class: a100}
          - {address: 10.0.0.2:8000, gpu_class: a100}
          - {address: 10.0.0.3:8000, gpu_class: a10}
          - {address: 10.0.0.4:8000, gpu_class: h100}
      - name: v2
        endpoints:
          - {address: 10.0.1.1:8000}
          - {address: 10.0.1.2:8000}
"""

ROUNDS = [
    {"10.0.0.1:8000": dict(gpu_util=0.2, running=1, latency_mean_ms=50),
     "10.0.0.2:8000": dict(gpu_util=0.9, running=6, latency_mean_ms=200),
     "10.0.0.3:8000": dict(gpu_util=0.5, running=2, latency_mean_ms=120),
     "10.0.0.4:8000": dict(gpu_util=0.1, running=0, latency_mean_ms=None),
     "10.0.1.1:8000": dict(gpu_util=0.4, running=3), "10.0.1.2:8000": dict(gpu_util=0.3, running=9)},
    {"10.0.0.1:8000": dict(gpu_util=0.6, running=4, latency_mean_ms=90),
     "10.0.0.2:8000": dict(gpu_util=0.3, running=1, latency_mean_ms=60),
     "10.0.0.3:8000": dict(gpu_util=0.5, running=2, latency_mean_ms=130, sample_age_s=40.0),
     "10.0.0.4:8000": dict(gpu_util=0.2, running=1, latency_mean_ms=40),
     "10.0.1.1:8000": dict(gpu_util=0.4, running=3), "10.0.1.2:8000": dict(gpu_util=0.3, running=2)},
]


def fetcher(rounds):
    it = iter(rounds)

    def fetch(instances):
        stats = next(it)
        return {i: EndpointStats(**{"sample_age_s": 1.0, **stats[i]}) for i in instances}
    return fetch


@pytest.mark.parametrize("rounds", [1, 2])
async def test_two_replicas_push_the_same_weights_and_pin_sessions_alike(rounds):
    replicas = []
    for _ in range(2):   # the weight loop is driven by hand here: rounds are the inputs
        app = InferLB(parse_config(CONFIG))
        app.control.source = metrics_source(fetcher(ROUNDS))
        replicas.append(app)
    for app in replicas:
        for _ in range(rounds):
            assert await app.control.run_round()
    a, b = replicas
    assert a.cache.snapshot.version == b.cache.snapshot.version
    assert {(w.cluster, w.address): (w.weight, w.health) for w in a.control.weights} == \
        {(w.cluster, w.address): (w.weight, w.health) for w in b.control.weights}
    if rounds == 2:   # the stale endpoint is excluded by both
        assert {w.address: w.health for w in a.control.weights}["10.0.0.3:8000"] == "UNHEALTHY"
    pins = []
    for app in replicas:
        view = app.view.current
        pins.append([pick({":authority": b"api", "x-session-id": f"user-{i}".encode(),
                           "model-version": v.encode()}, view).endpoint
                     for i in range(1000) for v in ("v1", "v2")])
    assert pins[0] == pins[1]
    assert len(set(pins[0])) >= 4 and None not in pins[0]
