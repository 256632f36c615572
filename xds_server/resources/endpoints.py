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


def build_assignment(cluster: str, weights: Iterable[EndpointWeight],
                     max_concurrency: Mapping[str, int] | None = None,
                     gpu_class: Mapping[str, str] | None = None,
                     tier: Mapping[str, str] | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment with one locality per priority; each endpoint's weight and health from the engine.

    An empty ``weights`` gives an assignment without endpoints (Envoy then has the cluster with no
    hosts instead of waiting for EDS). Built by attribute assignment: ~2.3 µs per endpoint, against
    ~8 µs with nested constructors (measured for the xDS benchmark); the metadata below adds ~45
    bytes per endpoint on the wire; its Metadata is built once per distinct value and copied.
    ``max_concurrency`` (address -> requests): written to each endpoint's metadata
    ``filter_metadata["inferlb"]["max_concurrency"]`` for the picker's admission control.
    ``gpu_class`` (address -> class name): written as ``filter_metadata["inferlb"]["gpu_class"]``
    (the picker learns its request cost model per GPU class).
    ``tier`` (address -> ``edge`` | ``cloud``; missing = edge): edge endpoints go to priority 0,
    cloud endpoints to priority 1 (Envoy sends a priority traffic only when the levels above it are
    not healthy enough: docs/envoy-facts.md, "Priority levels"); without an edge endpoint in
    ``weights`` the cloud endpoints are priority 0 (priorities must run 0..N without a gap).

    Raises:
        ValueError: a weight < 1 (Envoy NACKs it) — the engine guarantees this never happens.
    """
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    weights = list(weights)
    levels = sorted({TIER_PRIORITY[tier.get(w.address, "edge")] for w in weights}) if tier else [0]
    localities: dict[int, endpoint_pb2.LocalityLbEndpoints] = {}
    metas: dict[tuple, base_pb2.Metadata] = {}  # one Metadata per distinct set of values, copied in C++
    for w in weights:
        if w.weight < 1:
            raise ValueError(f"{cluster}/{w.address}: load_balancing_weight must be >= 1, got {w.weight}")
        level = levels.index(TIER_PRIORITY[tier.get(w.address, "edge")]) if tier else 0
        locality = localities.get(level)
        if locality is None:
            locality = localities[level] = cla.endpoints.add()
            locality.priority = level
        host, port = split_hostport(w.address)
        lb = locality.lb_endpoints.add()
        sock = lb.endpoint.address.socket_address
        sock.address = host
        sock.port_value = port
        lb.health_status = _HEALTH[w.health]
        lb.load_balancing_weight.value = w.weight
        fields = {}
        if max_concurrency and w.address in max_concurrency:
            fields["max_concurrency"] = max_concurrency[w.address]
        if gpu_class and w.address in gpu_class:
            fields["gpu_class"] = gpu_class[w.address]
        if fields:
            key = tuple(fields.items())
            meta = metas.get(key)
            if meta is None:
                meta = metas[key] = base_pb2.Metadata()
                meta.filter_metadata["inferlb"].update(fields)
            lb.metadata.CopyFrom(meta)
    return cla
