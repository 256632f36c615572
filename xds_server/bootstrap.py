"""Render the Envoy bootstrap (``envoy/bootstrap.yaml``) for a config.

The template's ``${...}`` fields are filled with JSON values (YAML is a superset of JSON), so
names and lists go in quoted and escaped.
"""

from __future__ import annotations

import json
from pathlib import Path
from string import Template

from .config import Config, cluster_name, split_hostport

TEMPLATE = Path(__file__).resolve().parent.parent / "envoy" / "bootstrap.yaml"
ROUTE_TIMEOUT = "120s"


def virtual_hosts(cfg: Config) -> list[dict]:
    """One virtual host per service: the picker's cluster header first, then the default version."""
    out = []
    for s in cfg.services:
        domains = []
        for h in s.hosts:
            domains += ["*"] if h == "*" else [h, f"{h}:*"]
        out.append({
            "name": s.name,
            "domains": domains,
            "routes": [
                {
                    "match": {"prefix": "/", "headers": [{"name": cfg.headers.cluster, "present_match": True}]},
                    "route": {"cluster_header": cfg.headers.cluster, "timeout": ROUTE_TIMEOUT},
                },
                {
                    "match": {"prefix": "/"},
                    "route": {"cluster": cluster_name(s.name, s.default), "timeout": ROUTE_TIMEOUT},
                },
            ],
        })
    return out


def render_bootstrap(cfg: Config, *, node_id: str, listener_port: int, admin_port: int,
                     xds_port: int | None = None, ext_proc_port: int | None = None,
                     node_cluster: str = "inferlb") -> str:
    """The bootstrap YAML text for one Envoy. Ports default to those in ``cfg.listen``.

    Raises:
        FileNotFoundError: the template is missing (not a source checkout).
    """
    xds_host, cfg_xds_port = split_hostport(cfg.listen.xds)
    ext_host, cfg_ext_port = split_hostport(cfg.listen.ext_proc)
    fields = {
        "node_id": node_id,
        "node_cluster": node_cluster,
        "admin_port": admin_port,
        "listener_port": listener_port,
        "xds_host": "127.0.0.1" if xds_host in ("0.0.0.0", "") else xds_host,
        "xds_port": xds_port or cfg_xds_port,
        "ext_proc_host": "127.0.0.1" if ext_host in ("0.0.0.0", "") else ext_host,
        "ext_proc_port": ext_proc_port or cfg_ext_port,
        "override_host_header": cfg.headers.override_host,
        "cluster_header": cfg.headers.cluster,
        "virtual_hosts": virtual_hosts(cfg),
    }
    return Template(TEMPLATE.read_text()).substitute({k: json.dumps(v) for k, v in fields.items()})
