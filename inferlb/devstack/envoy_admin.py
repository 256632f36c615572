"""Read what a running Envoy really has, from its admin API (``/clusters?format=json``, ``/stats``)."""

from __future__ import annotations

import json
import urllib.request


def admin_get(admin: str, path: str, timeout: float = 5.0) -> bytes:
    """The body of ``GET admin+path`` on Envoy's admin API. Raises ``OSError`` when unreachable."""
    with urllib.request.urlopen(f"{admin.rstrip('/')}{path}", timeout=timeout) as r:
        return r.read()


def envoy_hosts(admin: str) -> dict[str, dict[str, dict]]:
    """``{cluster: {"HOST:PORT": {"weight": int, "health": EDS health status}}}`` for every cluster.

    ``admin`` is the base URL, e.g. ``http://127.0.0.1:9901``. Raises ``OSError`` when unreachable.
    """
    doc = json.loads(admin_get(admin, "/clusters?format=json"))
    out: dict[str, dict[str, dict]] = {}
    for c in doc.get("cluster_statuses", []):
        hosts = {}
        for h in c.get("host_statuses", []):
            sa = h["address"]["socket_address"]
            hosts[f"{sa['address']}:{sa['port_value']}"] = {
                "weight": int(h.get("weight", 1)),
                "health": h.get("health_status", {}).get("eds_health_status", "HEALTHY"),
            }
        out[c["name"]] = hosts
    return out


