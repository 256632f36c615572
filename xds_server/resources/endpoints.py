"""EDS: one ClusterLoadAssignment per inference cluster from the engine's weights (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import split_hostport
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight

#: EDS priority of each tier (0 is the highest: Envoy's first choice).
TIER_PRIORITY = {"edge": 0, "cloud": 1}

_HEALTH = {
    HEALTHY: health_check_pb2.HEALTHY,
    UNHEALTHY: health_check_pb2.UNHEALTHY,
    DRAINING: health_check_pb2.DRAINING,
}


# What an endpoint without a value of its own writes when its locality has one: the picker reads
# max_concurrency <= 0 as "not limited" and gpu_class "" as "unknown", as if the field were absent.
_NONE = {"max_concurrency": 0, "gpu_class": ""}


def build_assignment(cluster: str, weights: Iterable[EndpointWeight],
                     max_concurrency: Mapping[str, int] | None = None,
                     gpu_class: Mapping[str, str] | None = None,
                     tier: Mapping[str, str] | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment with one locality per priority; each endpoint's weight and health from the engine.

    An empty ``weights`` gives an assignment without endpoints (Envoy then has the cluster with no
    hosts instead of waiting for EDS). Built by attribute assignment: ~2.3 µs per endpoint, against
    ~8 µs with nested constructors (measured for the xDS benchmark).
    ``max_concurrency`` (address -> requests) and ``gpu_class`` (address -> class name) are
    metadata ``filter_metadata["inferlb"]`` fields for the picker (its admission control and its
    request cost model per GPU class). Per locality, the most common pair of values is written
    once, as the locality's metadata; only an endpoint whose values differ carries its own (the
    fields that differ; a value the endpoint lacks is written as ``max_concurrency`` 0 /
    ``gpu_class`` ""). The picker reads an endpoint's own value, else its locality's
    (``ext_proc.view.cluster_details``).
    ``tier`` (address -> ``edge`` | ``cloud``; missing = edge): edge endpoints go to priority 0,
    cloud endpoints to priority 1 (Envoy sends a priority traffic only when the levels above it are
    not healthy enough: docs/envoy-facts.md, "Priority levels"); without an edge endpoint in
    ``weights`` the cloud endpoints are priority 0 (priorities must run 0..N without a gap).

    Raises:
        ValueError: a weight < 1 (Envoy NACKs it) — the engine guarantees this never happens.
    """
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    weights = list(weights)
    if not weights:
        return cla
    tiers = [TIER_PRIORITY[tier.get(w.address, "edge")] if tier else 0 for w in weights]
    levels = sorted(set(tiers))
    metas: dict[tuple, base_pb2.Metadata] = {}  # one Metadata per distinct difference, copied in C++
    for level, priority in enumerate(levels):
        members = [w for w, t in zip(weights, tiers, strict=True) if t == priority]
        _add_locality(cla, cluster, level, members, max_concurrency, gpu_class, metas)
    return cla


def _add_locality(cla: endpoint_pb2.ClusterLoadAssignment, cluster: str, priority: int,
                  weights: list[EndpointWeight], max_concurrency: Mapping[str, int] | None,
                  gpu_class: Mapping[str, str] | None, metas: dict[tuple, base_pb2.Metadata]) -> None:
    own: list[dict] = []
    counts: dict[tuple, int] = {}
    for w in weights:
        fields = {}
        if max_concurrency and w.address in max_concurrency:
            fields["max_concurrency"] = max_concurrency[w.address]
        if gpu_class and w.address in gpu_class:
            fields["gpu_class"] = gpu_class[w.address]
        own.append(fields)
        key = tuple(fields.items())
        counts[key] = counts.get(key, 0) + 1
    shared = dict(max(counts, key=lambda k: (counts[k], k)))  # the most common (ties: a fixed choice)
    locality = cla.endpoints.add()
    locality.priority = priority
    if shared:
        locality.metadata.filter_metadata["inferlb"].update(shared)
    for w, fields in zip(weights, own, strict=True):
        if w.weight < 1:
            raise ValueError(f"{cluster}/{w.address}: load_balancing_weight must be >= 1, got {w.weight}")
        host, port = split_hostport(w.address)
        lb = locality.lb_endpoints.add()
        sock = lb.endpoint.address.socket_address
        sock.address = host
        sock.port_value = port
        lb.health_status = _HEALTH[w.health]
        lb.load_balancing_weight.value = w.weight
        if fields == shared:
            continue
        differs = {k: fields.get(k, _NONE[k]) for k in (*shared, *fields) if fields.get(k) != shared.get(k)}
        key = tuple(differs.items())
        meta = metas.get(key)
        if meta is None:
            meta = metas[key] = base_pb2.Metadata()
            meta.filter_metadata["inferlb"].update(differs)
        lb.metadata.CopyFrom(meta)
