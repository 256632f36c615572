"""A gateway's bootstrap on one machine: its own listener and picker, the rest over ADS."""

from __future__ import annotations

import json

from inferlb.devstack.gateway import GATEWAY_PICKER, gateway_bootstrap
from tests.support.factories import config
from xds_server.resources.names import EXT_PROC_CLUSTER


def _clusters_named(doc) -> set[str]:
    if isinstance(doc, dict):
        found = {doc["cluster_name"]} if isinstance(doc.get("cluster_name"), str) else set()
        return found.union(*(_clusters_named(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(_clusters_named(v) for v in doc))
    return set()


def test_the_gateway_takes_its_listener_and_picker_from_the_bootstrap_and_the_rest_over_ads():
    boot = json.loads(gateway_bootstrap(config(), xds_address="127.0.0.1:18000", node_id="gw-1", admin_port=9901,
                                        listener_port=10001, picker_address="127.0.0.1:18081"))
    assert "lds_config" not in boot["dynamic_resources"] and "cds_config" in boot["dynamic_resources"]
    [listener] = boot["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10001}
    named = _clusters_named(listener)
    assert GATEWAY_PICKER in named and EXT_PROC_CLUSTER not in named  # ext_proc and the completion log
    picker = next(c for c in boot["static_resources"]["clusters"] if c["name"] == GATEWAY_PICKER)
    [endpoint] = picker["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18081}
    assert boot["node"]["id"] == "gw-1"
