"""The requests each backend held in its sample, read from a round's weights for the picker."""

from __future__ import annotations

import math

from inferlb.serve import held_counts, memory_samples
from xds_server.engine.types import EndpointWeight
from xds_server.metrics.stats import EndpointStats


def _weight(address: str, **stats: float | None) -> EndpointWeight:
    return EndpointWeight("chat-v1", address, 1, "HEALTHY", 1.0, EndpointStats(**stats), {}, ())


def test_only_endpoints_with_a_memory_sample_and_a_known_count_get_one():
    weights = [_weight("a:1", gpu_mem_free_mib=1000.0, in_flight=3.0, sample_age_s=0.2),
               _weight("b:1", gpu_mem_free_mib=1000.0, in_flight=None, sample_age_s=0.2),   # no count
               _weight("c:1", in_flight=2.0, sample_age_s=0.2),                              # no memory
               _weight("d:1", gpu_mem_free_mib=1000.0, in_flight=math.nan, sample_age_s=0.2),
               _weight("e:1", gpu_mem_free_mib=1000.0, in_flight=0.0, sample_age_s=0.2)]
    samples = memory_samples(weights, lambda cluster, address: None, now=100.0)
    assert sorted(samples) == ["a:1", "b:1", "d:1", "e:1"]
    assert held_counts(weights, samples) == {"a:1": 3.0, "e:1": 0.0}
