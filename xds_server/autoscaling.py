"""The autoscaling signal of one cluster: saturation, queue, wait and a suggested replica count (pure).

Inputs per cluster (:class:`ClusterLoad`): the live load (requests the picker sent and Envoy has
not reported finished, and requests waiting in the picker's admission queue), the serving
endpoints (HEALTHY in EDS) and their max concurrency, the requests waiting at the backends and
the backends' finished requests per second. The rules, each with its source:

- **saturation** = (in flight + waiting in the picker) / the serving endpoints' max concurrency.
  Exported clamped to 0-1 (1 = full or over); the replica rule uses the unclamped value.
- **queue** = waiting in the picker + waiting at the backends (vLLM ``num_requests_waiting``).
- **wait** = queue / finished requests per second: Little's law, L = lambda W (J. D. C. Little,
  "A Proof for the Queuing Formula L = lambda W", Operations Research 9(3), 1961), read as the
  expected wait of a request joining the queue now. Unknown (None) when requests wait and the
  backends report no throughput.
- **desired replicas** = ``ceil(current x saturation / target)``, the Kubernetes
  HorizontalPodAutoscaler algorithm ("Algorithm details" in the Kubernetes docs:
  ``desiredReplicas = ceil[currentReplicas * (currentMetricValue / desiredMetricValue)]``), with
  its tolerance: no change while the ratio is within ``1 +- tolerance`` (HPA default 0.1). With
  no serving endpoint, ``ceil(demand / (one replica's max concurrency x target))`` (scale from zero).

Exported by :class:`xds_server.admin.exposition.AutoscalingCollector`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xds_server.config import Config, cluster_name
from xds_server.engine.types import HEALTHY, EndpointWeight

__all__ = ["ClusterLoad", "ClusterSignal", "cluster_loads", "desired_replicas", "signal"]


@dataclass(frozen=True)
class ClusterLoad:
    """What the signal of one cluster is computed from.

    Attributes:
        cluster: the Envoy cluster name.
        replicas: endpoints serving now (HEALTHY).
        capacity: the sum of their max concurrency (requests).
        replica_capacity: one replica's max concurrency (requests, > 0; the mean over the
            cluster's configured endpoints): the scale of a cluster with no serving endpoint.
        in_flight: requests in flight (the picker's picks minus Envoy's completions).
        picker_queued: requests waiting in the picker's admission queue.
        backend_queued: requests waiting at the backends (sum of their waiting-requests metric;
            0 when unknown).
        finished_per_s: finished requests per second over the metrics window (None: unknown).
    """

    cluster: str
    replicas: int
    capacity: int
    replica_capacity: float
    in_flight: float
    picker_queued: float = 0.0
    backend_queued: float = 0.0
    finished_per_s: float | None = None


@dataclass(frozen=True)
class ClusterSignal:
    """The signal of one cluster (see the module docstring for each rule).

    Attributes:
        cluster: the cluster name.
        saturation: 0-1.
        queue: requests waiting (picker + backends).
        wait_s: expected wait in the queue (s), None when unknown.
        replicas: endpoints serving now.
        desired_replicas: the suggested replica count (>= 0).
    """

    cluster: str
    saturation: float
    queue: float
    wait_s: float | None
    replicas: int
    desired_replicas: int


def desired_replicas(current: int, utilisation: float, target: float, tolerance: float = 0.1) -> int:
    """The HPA rule: ``ceil(current x utilisation / target)``, ``current`` while the ratio is within
    ``1 +- tolerance``. ``utilisation`` and ``target`` in the same unit (> 0 for target).

    >>> desired_replicas(4, 0.9, 0.6), desired_replicas(4, 0.63, 0.6), desired_replicas(4, 0.1, 0.6)
    (6, 4, 1)

    Raises:
        ValueError: ``target`` <= 0, ``current`` < 0 or ``tolerance`` < 0.
    """
    if target <= 0 or current < 0 or tolerance < 0:
        raise ValueError(f"desired_replicas: target > 0, current >= 0, tolerance >= 0 needed; "
                         f"got {target}, {current}, {tolerance}")
    ratio = utilisation / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - 1e-9)


def signal(load: ClusterLoad, target: float, tolerance: float = 0.1) -> ClusterSignal:
    """The autoscaling signal of one cluster; ``target``: the saturation to run at (0-1].

    Raises:
        ValueError: ``target`` not in (0, 1], ``replica_capacity`` <= 0, or a negative count.
    """
    if not 0 < target <= 1 or load.replica_capacity <= 0:
        raise ValueError(f"{load.cluster}: target in (0, 1] and replica_capacity > 0 needed; "
                         f"got {target}, {load.replica_capacity}")
    if min(load.replicas, load.capacity, load.in_flight, load.picker_queued, load.backend_queued) < 0:
        raise ValueError(f"{load.cluster}: negative count in {load}")
    demand = load.in_flight + load.picker_queued
    queue = load.picker_queued + load.backend_queued
    if load.replicas > 0 and load.capacity > 0:
        utilisation = demand / load.capacity
        desired = desired_replicas(load.replicas, utilisation, target, tolerance)
    else:
        utilisation = 1.0 if demand > 0 else 0.0
        desired = math.ceil(demand / (load.replica_capacity * target) - 1e-9)
    rate = load.finished_per_s
    if queue == 0:
        wait: float | None = 0.0
    elif rate is not None and rate > 0:
        wait = queue / rate
    else:
        wait = None
    return ClusterSignal(load.cluster, min(1.0, utilisation), queue, wait, load.replicas, desired)


def cluster_loads(cfg: Config, weights: Iterable[EndpointWeight], in_flight: Mapping[str, float],
                  picker_queued: Mapping[str, float]) -> list[ClusterLoad]:
    """One :class:`ClusterLoad` per configured cluster, in config order (pure).

    ``weights``: the last round's verdicts (health; the inputs ``queue``, waiting requests, and
    ``request_rate``, finished per second); ``in_flight`` / ``picker_queued``: ``{cluster:
    requests}`` from the picker (missing = 0). Serving = HEALTHY; each endpoint's max concurrency
    comes from ``cfg``. An endpoint without a verdict yet does not serve.
    """
    by_cluster: dict[str, list[EndpointWeight]] = {}
    for w in weights:
        by_cluster.setdefault(w.cluster, []).append(w)
    out = []
    for service in cfg.services:
        for version in service.versions:
            name = cluster_name(service.name, version.name)
            limits = {e.address: e.max_concurrency for e in version.endpoints}
            serving = [w for w in by_cluster.get(name, ()) if w.health == HEALTHY and w.address in limits]
            rates = [w.inputs.request_rate for w in serving if w.inputs.request_rate is not None]
            out.append(ClusterLoad(
                cluster=name,
                replicas=len(serving),
                capacity=sum(limits[w.address] for w in serving),
                replica_capacity=sum(limits.values()) / len(limits),
                in_flight=float(in_flight.get(name, 0.0)),
                picker_queued=float(picker_queued.get(name, 0.0)),
                backend_queued=sum(w.inputs.queue or 0.0 for w in serving),
                finished_per_s=sum(rates) if rates else None,
            ))
    return out
