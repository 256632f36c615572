"""The autoscaling signal: saturation, queue, wait, the HPA replica rule, and its exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.factories import config, service, version, weight
from xds_server.admin.exposition import AUTOSCALING, AutoscalingCollector
from xds_server.autoscaling import ClusterLoad, cluster_loads, desired_replicas, signal
from xds_server.config.model import Autoscaling
from xds_server.engine.types import DRAINING, UNHEALTHY
from xds_server.metrics.stats import EndpointStats


def load(**kw) -> ClusterLoad:
    base = dict(cluster="llm-v1", replicas=4, capacity=32, replica_capacity=8.0, in_flight=0.0)
    return ClusterLoad(**{**base, **kw})


@pytest.mark.parametrize(("current", "utilisation", "target", "want"), [
    (4, 0.6, 0.6, 4),     # on target
    (4, 0.65, 0.6, 4),    # ratio 1.083: within the 0.1 tolerance
    (4, 0.9, 0.6, 6),     # ratio 1.5: ceil(6.0)
    (4, 1.0, 0.7, 6),     # ceil(5.71)
    (4, 0.3, 0.6, 2),     # scale down: ceil(2.0)
    (4, 0.0, 0.6, 0),     # idle: the scaler's minimum applies
    (0, 0.0, 0.6, 0),
])
def test_the_hpa_rule(current, utilisation, target, want):
    assert desired_replicas(current, utilisation, target) == want


def test_the_rule_refuses_a_target_of_zero():
    with pytest.raises(ValueError, match="target"):
        desired_replicas(2, 0.5, 0.0)


def test_saturation_counts_the_picker_queue_and_clamps_at_one():
    s = signal(load(in_flight=16, picker_queued=0), target=0.5)
    assert s.saturation == 0.5 and s.desired_replicas == 4
    s = signal(load(in_flight=32, picker_queued=16), target=0.5)
    # Over capacity: saturation shows 1, the rule uses 48/32 = 1.5 -> ceil(4 x 1.5 / 0.5) = 12.
    assert s.saturation == 1.0 and s.desired_replicas == 12


def test_queue_and_wait_by_littles_law():
    s = signal(load(in_flight=30, picker_queued=2, backend_queued=6, finished_per_s=4.0), target=0.7)
    assert s.queue == 8 and s.wait_s == 2.0
    assert signal(load(in_flight=3), target=0.7).wait_s == 0.0            # nobody waits
    assert signal(load(in_flight=9, backend_queued=1), target=0.7).wait_s is None   # waits, rate unknown


def test_no_serving_endpoint_scales_from_zero_by_one_replicas_capacity():
    s = signal(load(replicas=0, capacity=0, in_flight=0, picker_queued=10), target=0.5)
    assert s.saturation == 1.0 and s.desired_replicas == 3   # ceil(10 / (8 x 0.5))
    assert signal(load(replicas=0, capacity=0), target=0.5).desired_replicas == 0


def test_loads_from_the_config_the_verdicts_and_the_picker():
    eps = [{"address": f"10.0.0.{i}:8000", "max_concurrency": 4 * i} for i in (1, 2, 3)]
    cfg = config([service("llm", [version("v1", eps), version("v2", 1)])])
    verdicts = [
        weight("llm-v1", "10.0.0.1:8000", 10)._replace(inputs=EndpointStats(queue=2.0, request_rate=1.5)),
        weight("llm-v1", "10.0.0.2:8000", 10)._replace(inputs=EndpointStats(queue=1.0, request_rate=0.5)),
        weight("llm-v1", "10.0.0.3:8000", 10, UNHEALTHY),
    ]
    loads = cluster_loads(cfg, verdicts, {"llm-v1": 5}, {"llm-v1": 2})
    assert loads[0] == ClusterLoad("llm-v1", replicas=2, capacity=12, replica_capacity=8.0, in_flight=5.0,
                                   picker_queued=2.0, backend_queued=3.0, finished_per_s=2.0)
    assert loads[1].cluster == "llm-v2" and loads[1].replicas == 0 and loads[1].finished_per_s is None
    assert cluster_loads(cfg, [weight("llm-v2", cfg.services[0].versions[1].endpoints[0].address, 1, DRAINING)],
                         {}, {})[1].replicas == 0


def test_the_exposition_has_every_family_with_help_and_the_cluster_label():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AutoscalingCollector(
        lambda: [load(in_flight=24, backend_queued=4, finished_per_s=2.0), load(cluster="llm-v2", in_flight=1,
                                                                                  backend_queued=1)],
        lambda: Autoscaling(target_saturation=0.5)))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert set(families) == set(AUTOSCALING)
    for name, family in families.items():
        assert family.type == "gauge" and family.documentation == AUTOSCALING[name]
    value = {(f.name, s.labels["cluster"]): s.value for f in families.values() for s in f.samples}
    assert value[("inferlb_cluster_saturation_ratio", "llm-v1")] == 0.75
    assert value[("inferlb_cluster_desired_replicas", "llm-v1")] == 6
    assert value[("inferlb_cluster_queue_wait_seconds", "llm-v1")] == 2.0
    assert ("inferlb_cluster_queue_wait_seconds", "llm-v2") not in value   # unknown: no sample, never a fake 0
    assert value[("inferlb_cluster_replicas", "llm-v2")] == 4
