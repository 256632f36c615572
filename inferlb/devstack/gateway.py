"""Several gateways (Envoy + its own picker) on one machine, for tests and benchmarks.

In a deployment each gateway runs on its own node: the same listener port and the same picker
address (``127.0.0.1:18080`` next to its Envoy) on every node, so the control plane serves one
listener and one picker cluster to all of them. On one machine they would collide. A gateway
started here takes its listener and its picker cluster from its bootstrap instead (static
resources: the control plane's own listener, built by :func:`xds_server.resources.listener.build_listener`,
on the gateway's port and pointed at the gateway's picker) and only clusters and endpoints (CDS,
EDS, RDS) over ADS; everything else is as the control plane says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from inferlb.devstack import stack
from xds_server.config import Config
from xds_server.resources.bootstrap import render_bootstrap
from xds_server.resources.clusters import build_ext_proc_cluster
from xds_server.resources.listener import build_listener
from xds_server.resources.names import EXT_PROC_CLUSTER

__all__ = ["GATEWAY_PICKER", "gateway_bootstrap", "start_gateway_picker"]

#: The static cluster of a gateway's own picker (the ADS-served ``inferlb_ext_proc`` stays unused).
GATEWAY_PICKER = "gateway_picker"


def _renamed(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: (GATEWAY_PICKER if k == "cluster_name" and v == EXT_PROC_CLUSTER else _renamed(v))
                for k, v in doc.items()}
    if isinstance(doc, list):
        return [_renamed(v) for v in doc]
    return doc


def gateway_bootstrap(cfg: Config, *, xds_address: str, node_id: str, admin_port: int, listener_port: int,
                      picker_address: str) -> str:
    """The bootstrap (YAML) of one gateway: ``cfg``'s listener on ``127.0.0.1:listener_port`` whose
    ext_proc filter and completion log go to the picker at ``picker_address`` (``HOST:PORT``),
    clusters, routes and endpoints from the ADS server at ``xds_address``."""
    boot = yaml.safe_load(render_bootstrap(xds_address=xds_address, node_id=node_id, admin_port=admin_port))
    del boot["dynamic_resources"]["lds_config"]
    local = cfg.model_copy(update={"envoy": cfg.envoy.model_copy(update={"listener": f"127.0.0.1:{listener_port}"})})
    listener = _renamed(json_format.MessageToDict(build_listener(local), preserving_proto_field_name=True))
    picker = json_format.MessageToDict(build_ext_proc_cluster(picker_address), preserving_proto_field_name=True)
    picker["name"] = picker["load_assignment"]["cluster_name"] = GATEWAY_PICKER
    boot["static_resources"]["clusters"].append(picker)
    boot["static_resources"]["listeners"] = [listener]
    return json.dumps(boot, indent=1)  # JSON is YAML: Envoy reads it as its bootstrap


def start_gateway_picker(xds_address: str, port: int, workdir: Path, name: str) -> stack.Proc:
    """A standalone picker (``inferlb ext-proc --xds``) named ``name`` (its xDS node id and its
    name in the shared load view) on ``127.0.0.1:port``."""
    return stack.spawn(name, stack.inferlb_argv("ext-proc", "--xds", xds_address, "--listen", f"127.0.0.1:{port}",
                                                "--node-id", name), workdir)
