"""Endpoints from InferencePools (``inference.networking.k8s.io/v1``) and their pods (pure).

An InferencePool is the Gateway API Inference Extension's backend: a label selector over pods in
its namespace and up to 8 target ports, each port of each pod one endpoint ``podIP:port``
(``api/v1/inferencepool_types.go`` in kubernetes-sigs/gateway-api-inference-extension: "Every port
will be treated as a distinctive endpoint by EPP, addressable as a 'podIP:portNumber' combination").
A pod is a member while it is ready: no ``deletionTimestamp`` and its ``Ready`` condition ``True``
(the reference picker's rule, ``pkg/lwepp/util/pod/pod.go`` there), with a pod IP.

:func:`endpoints_from_pools` turns the pools and pods the API server lists (API JSON, camelCase)
into inferlb endpoints per service and version; the watcher that feeds it is
:class:`xds_server.discovery.kubernetes.KubernetesWatcher`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter

from xds_server.config import KubernetesDiscovery
from xds_server.discovery.services import Discovered

__all__ = ["GROUP", "PLURAL", "VERSION", "endpoints_from_pools", "pod_ready"]

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"

POOLS_SKIPPED = Counter("inferlb_discovery_inferencepools_skipped_total",
                        "InferencePools left out (no selector or no target port), by reason", ["reason"])


def _get(obj: object, *path: str) -> object:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def pod_ready(pod: Mapping) -> bool:
    """A pod takes traffic: not being deleted, condition ``Ready`` is ``"True"``, and it has an IP.

    >>> pod_ready({"status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    True
    >>> pod_ready({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"},
    ...            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}})
    False
    """
    if _get(pod, "metadata", "deletionTimestamp") or not _get(pod, "status", "podIP"):
        return False
    conditions = _get(pod, "status", "conditions")
    return any(_get(c, "type") == "Ready" and _get(c, "status") == "True"
               for c in conditions if isinstance(c, Mapping)) if isinstance(conditions, list) else False


def _selector(pool: Mapping) -> dict[str, str] | None:
    labels = _get(pool, "spec", "selector", "matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        return None
    return {str(k): str(v) for k, v in labels.items()}


def _ports(pool: Mapping) -> list[int]:
    ports = _get(pool, "spec", "targetPorts")
    numbers = [_get(p, "number") for p in ports] if isinstance(ports, list) else []
    return sorted({n for n in numbers if isinstance(n, int) and 0 < n < 65536})


def endpoints_from_pools(pools: Iterable[Mapping], pods: Iterable[Mapping], spec: KubernetesDiscovery) -> Discovered:
    """InferencePools + pods (API JSON) -> ``{service: {version: [endpoint mapping]}}`` for
    ``spec.inference_pools``.

    A pool without a ``matchLabels`` selector or without a valid target port is left out (counted
    in ``inferlb_discovery_inferencepools_skipped_total{reason}``). Ready pods only (:func:`pod_ready`);
    a pod's version is its ``spec.version_label`` label, else the pool entry's ``version``; its GPU
    class its ``spec.gpu_class_label`` label, else ``spec.default_gpu_class``. Versions and
    endpoints come sorted, so two control planes given the same inputs produce the same config.
    """
    by_pool = {p.pool: p for p in spec.inference_pools}
    out: Discovered = {p.name: {} for p in spec.inference_pools}
    members = [(pod, _get(pod, "metadata", "labels") or {}) for pod in pods if pod_ready(pod)]
    for pool in pools:
        entry = by_pool.get(_get(pool, "metadata", "name"))  # type: ignore[arg-type]
        if entry is None:
            continue
        selector, ports = _selector(pool), _ports(pool)
        if selector is None or not ports:
            POOLS_SKIPPED.labels("no-selector" if selector is None else "no-target-port").inc()
            continue
        seen: set[str] = set()
        for pod, labels in members:
            if any(labels.get(k) != v for k, v in selector.items()):  # type: ignore[union-attr]
                continue
            ip = str(_get(pod, "status", "podIP"))
            version = labels.get(spec.version_label) or entry.version  # type: ignore[union-attr]
            for port in ports:
                address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if address in seen:
                    continue
                seen.add(address)
                out[entry.name].setdefault(version, []).append({
                    "address": address,
                    "gpu_class": labels.get(spec.gpu_class_label, spec.default_gpu_class),  # type: ignore[union-attr]
                    "max_concurrency": entry.max_concurrency,
                })
    return {name: {v: sorted(eps, key=lambda e: e["address"]) for v, eps in sorted(versions.items())}
            for name, versions in out.items()}
