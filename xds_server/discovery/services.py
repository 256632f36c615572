"""What discovery found, as config services (pure; shared by the etcd and Kubernetes sources)."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Discovered", "DiscoveredService", "add_endpoint", "in_order", "service_entry"]

#: ``{service name: {version: [endpoint mapping as in the config]}}``
Discovered = dict[str, dict[str, list[dict]]]


class DiscoveredService(Protocol):
    """The fields of a discovery source's service entry (``EtcdService``, ``KubernetesService``)."""

    name: str
    hosts: tuple[str, ...]
    lb_policy: str
    models: tuple[str, ...]
    default_version: str | None


def service_entry(svc: DiscoveredService, versions: dict[str, list[dict]]) -> dict[str, Any]:
    """The config mapping of one discovered service with at least one version with endpoints.

    A configured ``default_version`` with no endpoints now (every node of it left) stays the default
    and is listed in ``unavailable_versions``: its requests get a 503 naming it, never another
    version's model (the version whose nodes are there may serve a different model or format).

    >>> class S: name, hosts, lb_policy, models, default_version = "chat", ("*",), "least_request", (), "v2"
    >>> e = service_entry(S, {"v1": [{"address": "10.0.0.1:8000"}]})
    >>> e["default_version"], e["unavailable_versions"], [v["name"] for v in e["versions"]]
    ('v2', ['v2'], ['v1'])
    """
    default = svc.default_version
    return {"name": svc.name, "hosts": list(svc.hosts), "lb_policy": svc.lb_policy, "models": list(svc.models),
            **({"default_version": default} if default else {}),
            **({"unavailable_versions": [default]} if default and default not in versions else {}),
            "versions": [{"name": v, "endpoints": eps} for v, eps in versions.items()]}


def add_endpoint(versions: dict[str, list[dict]], seen: set[str], version: str, ip: str, port: int,
                 gpu_class: str, max_concurrency: int) -> None:
    """Add the endpoint ``ip:port`` (an IPv6 address in brackets) of ``version`` to ``versions``,
    as the config maps it, unless ``seen`` has its address already (then nothing)."""
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    if address in seen:
        return
    seen.add(address)
    versions.setdefault(version, []).append(
        {"address": address, "gpu_class": gpu_class, "max_concurrency": max_concurrency})


def in_order(discovered: Discovered) -> Discovered:
    """``discovered`` with its versions and each version's endpoints sorted (by name, by address), so
    two control planes given the same inputs produce the same config."""
    return {name: {v: sorted(eps, key=lambda e: e["address"]) for v, eps in sorted(versions.items())}
            for name, versions in discovered.items()}
