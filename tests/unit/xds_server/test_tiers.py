"""Edge -> cloud tiers in the config and in EDS: priority 0 (edge) and 1 (cloud)."""

from __future__ import annotations

import pytest

from inferlb.picker_config import routing_table
from tests.support.factories import config, service, version, weight, yaml_text
from tests.support.snapshots import assignments_of
from xds_server.config import ConfigError, parse_config
from xds_server.engine.types import UNHEALTHY
from xds_server.resources.build import build_snapshot
from xds_server.resources.endpoints import build_assignment

EDGE = ["10.0.0.1:8000", "10.0.0.2:8000"]
CLOUD = ["10.9.0.1:8000"]


def tiered_config(**sections):
    endpoints = [{"address": a} for a in EDGE] + [{"address": a, "tier": "cloud"} for a in CLOUD]
    return config([service("llm", [version("v1", endpoints)])], **sections)


def priorities(cla) -> dict[int, list[str]]:
    return {loc.priority: sorted(f"{lb.endpoint.address.socket_address.address}:"
                                 f"{lb.endpoint.address.socket_address.port_value}" for lb in loc.lb_endpoints)
            for loc in cla.endpoints}


def test_edge_endpoints_are_priority_0_and_cloud_endpoints_priority_1():
    cfg = tiered_config()
    assert [e.tier for e in cfg.services[0].versions[0].endpoints] == ["edge", "edge", "cloud"]
    weights = [weight("llm-v1", a, 10) for a in EDGE + CLOUD]
    snap = build_snapshot(cfg, weights, "127.0.0.1:18080")
    assert priorities(assignments_of(snap)["llm-v1"]) == {0: EDGE, 1: CLOUD}


def test_without_a_tier_everything_is_one_locality_at_priority_0():
    cla = build_assignment("c", [weight("c", a, 10) for a in EDGE])
    assert len(cla.endpoints) == 1 and priorities(cla) == {0: EDGE}


def test_cloud_endpoints_move_up_to_priority_0_when_no_edge_endpoint_is_left():
    """Priorities must run 0..N without a gap (Envoy refuses a lone priority 1)."""
    cla = build_assignment("c", [weight("c", CLOUD[0], 10)], tier={CLOUD[0]: "cloud"})
    assert priorities(cla) == {0: CLOUD}
    # Unhealthy edge endpoints stay at priority 0: Envoy's health-based spill needs them there.
    cla = build_assignment("c", [weight("c", EDGE[0], 1, UNHEALTHY), weight("c", CLOUD[0], 10)],
                           tier={CLOUD[0]: "cloud"})
    assert priorities(cla) == {0: [EDGE[0]], 1: CLOUD}


def test_a_version_with_only_cloud_endpoints_is_refused_naming_the_field():
    text = yaml_text("""
        services:
          - name: llm
            versions:
              - name: v1
                endpoints:
                  - {address: 10.0.0.1:8000, tier: cloud}
        """)
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    assert "services[0].versions[0].endpoints" in str(info.value) and "edge endpoint" in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("tier", "fog"), ("spill_threshold", 0), ("spill_threshold", 1.5)])
def test_bad_tier_or_threshold_is_refused(field, value):
    with pytest.raises(ConfigError) as info:
        if field == "tier":
            config([service("llm", [version("v1", [{"address": "10.0.0.1:8000", "tier": value}])])])
        else:
            tiered_config(picker={"spill_threshold": value})
    assert field in str(info.value)


def test_the_threshold_reaches_the_picker():
    assert routing_table(tiered_config()).spill_threshold == 0.6
    assert routing_table(tiered_config(picker={"spill_threshold": 0.8})).spill_threshold == 0.8
