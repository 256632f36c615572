"""Render the Envoy bootstrap (the template ``bootstrap.yaml`` beside this module, shipped as package
data): node identity, admin port, the ADS server.

Everything else reaches Envoy over xDS. The template's ``${...}`` fields are filled with JSON
values (YAML is a superset of JSON), so names go in quoted and escaped.
"""

from __future__ import annotations

import ipaddress
import json
from importlib import resources
from string import Template

from xds_server.ads.server import MAX_MESSAGE_BYTES
from xds_server.config import EnvoyTls, split_hostport
from xds_server.resources.clusters import upstream_tls

#: The bootstrap template (``${...}`` fields), read from the installed package.
TEMPLATE = resources.files("xds_server.resources").joinpath("bootstrap.yaml")


def render_bootstrap(*, xds_address: str, node_id: str, admin_port: int, node_cluster: str = "inferlb",
                     delta: bool = False, tls: EnvoyTls | None = None) -> str:
    """The bootstrap YAML text for one Envoy.

    ``xds_address``: the ADS server as ``HOST:PORT`` (0.0.0.0 becomes 127.0.0.1; an IP makes the xDS
    cluster ``STATIC``, a host name ``STRICT_DNS``, one host per address it resolves to); ``node_cluster``:
    picks the node group (``node_groups`` in the config); ``delta``: incremental ADS
    (``DELTA_GRPC``) instead of State-of-the-World (``GRPC``).
    ``tls``: dial the ADS server over TLS (CA to trust; client cert/key for mTLS): the xDS cluster
    gets an ``UpstreamTlsContext``.

    """
    host, port = split_hostport(xds_address)
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    try:
        ipaddress.ip_address(host)
        cluster_type = "STATIC"
    except ValueError:   # a host name: a STATIC cluster takes IP addresses only
        cluster_type = "STRICT_DNS"
    fields = {
        "node_id": node_id,
        "node_cluster": node_cluster,
        "admin_port": admin_port,
        "xds_host": host,
        "xds_port": port,
        "api_type": "DELTA_GRPC" if delta else "GRPC",
        "max_message_bytes": MAX_MESSAGE_BYTES,
    }
    values = {k: json.dumps(v) for k, v in fields.items()}
    values["xds_cluster_type"] = cluster_type
    values["xds_transport_socket"] = f"\n      transport_socket: {json.dumps(upstream_tls(tls))}" if tls else ""
    return Template(TEMPLATE.read_text()).substitute(values)
