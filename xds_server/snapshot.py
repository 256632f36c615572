"""Config + engine weights -> one immutable, versioned set of xDS resources (pure).

Each resource carries its own version (a digest of its deterministic serialisation), so the ADS
server can tell exactly which clusters changed and re-send only those. Type versions are digests
of the ``(name, version)`` pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, extension_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from .config import Config, EnvoySide, OutlierDetection, ServiceConfig, cluster_name, split_hostport
from .engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight
from .listener import (
    EXT_PROC_CLUSTER,
    LISTENER_NAME,
    ROUTE_NAME,
    build_ext_proc_cluster,
    build_listener,
    build_route_config,
)

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
#: Push order (xDS protocol doc, "eventual consistency considerations"): clusters, then their
#: endpoints, then listeners, then routes, so nothing points at a resource Envoy doesn't have yet.
TYPE_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)

_HEALTH = {
    HEALTHY: health_check_pb2.HEALTHY,
    UNHEALTHY: health_check_pb2.UNHEALTHY,
    DRAINING: health_check_pb2.DRAINING,
}


@dataclass(frozen=True, slots=True)
class Resource:
    """One xDS resource: ``version`` is a 16-hex digest of ``packed`` (the Any-wrapped message)."""

    name: str
    version: str
    packed: any_pb2.Any


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the control plane serves at one moment.

    ``resources``: ``{type_url: {name: Resource}}``; ``versions``: ``{type_url: type version}``;
    ``version``: digest over all types.
    """

    resources: Mapping[str, Mapping[str, Resource]]
    versions: Mapping[str, str]
    version: str

    def of(self, type_url: str) -> Mapping[str, Resource]:
        """The resources of one type (empty mapping for a type we don't serve)."""
        return self.resources.get(type_url, MappingProxyType({}))

    def assignments(self) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
        """Every ClusterLoadAssignment, by cluster name (what the picker's endpoint view is built from)."""
        out = {}
        for name, res in self.of(ENDPOINT_TYPE).items():
            cla = endpoint_pb2.ClusterLoadAssignment()
            res.packed.Unpack(cla)
            out[name] = cla
        return out


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()


def _resource(name: str, msg: Message) -> Resource:
    packed = any_pb2.Any()
    packed.Pack(msg)
    return Resource(name, _digest([msg.SerializeToString(deterministic=True)]), packed)


def _policy(name: str, msg: Message) -> cluster_pb2.LoadBalancingPolicy.Policy:
    cfg = any_pb2.Any()
    cfg.Pack(msg)
    return cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=cfg)
    )


def _outlier(o: OutlierDetection) -> outlier_detection_pb2.OutlierDetection:
    """Envoy outlier detection from the config (a per-try timeout counts as a gateway failure)."""
    def dur(s: float) -> duration_pb2.Duration:
        d = duration_pb2.Duration()
        d.FromNanoseconds(int(s * 1e9))
        return d

    return outlier_detection_pb2.OutlierDetection(
        consecutive_5xx=wrappers_pb2.UInt32Value(value=o.consecutive_5xx),
        consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=o.consecutive_gateway_failure),
        enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=100),
        interval=dur(o.interval_s),
        base_ejection_time=dur(o.base_ejection_time_s),
        max_ejection_time=dur(max(o.max_ejection_time_s, o.base_ejection_time_s)),
        max_ejection_percent=wrappers_pb2.UInt32Value(value=o.max_ejection_percent),
    )


def _retry_budget(envoy: EnvoySide) -> circuit_breaker_pb2.CircuitBreakers:
    """A retry budget instead of Envoy's fixed max_retries (3) circuit breaker."""
    budget = circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
        budget_percent=percent_pb2.Percent(value=envoy.retry_budget_percent),
        min_retry_concurrency=wrappers_pb2.UInt32Value(value=envoy.min_retry_concurrency),
    )
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=base_pb2.DEFAULT, retry_budget=budget)])


def build_cluster(name: str, service: ServiceConfig, override_host_header: str,
                  envoy: EnvoySide | None = None) -> cluster_pb2.Cluster:
    """An EDS cluster over ADS whose LB policy is ``envoy.load_balancing_policies.override_host``.

    The picker pins a host through ``override_host_header``; unpinned requests (and hosts not in the
    cluster) go to the fallback policy, which honours EDS ``load_balancing_weight`` (see
    shared/ENVOY-NOTES.md: override_host ignores health, so the picker pins only healthy hosts).
    """
    fallback = (
        _policy("envoy.load_balancing_policies.least_request", least_request_pb2.LeastRequest())
        if service.lb_policy == "least_request"
        else _policy("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())
    )
    override = override_host_pb2.OverrideHost(
        override_host_sources=[override_host_pb2.OverrideHost.OverrideHostSource(header=override_host_header)],
        fallback_policy=cluster_pb2.LoadBalancingPolicy(policies=[fallback]),
    )
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(service.connect_timeout_s * 1e9))
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=timeout,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            )
        ),
        load_balancing_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[_policy("envoy.load_balancing_policies.override_host", override)]
        ),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=service.panic_threshold_percent)
        ),
    )
    if envoy is not None:
        cluster.outlier_detection.CopyFrom(_outlier(envoy.outlier_detection))
        cluster.circuit_breakers.CopyFrom(_retry_budget(envoy))
    return cluster


def build_assignment(cluster: str, weights: Iterable[EndpointWeight]) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment with one locality; each endpoint's weight and health from the engine.

    Raises:
        ValueError: a weight < 1 (Envoy NACKs it) — the engine guarantees this never happens.
    """
    lb = []
    for w in weights:
        if w.weight < 1:
            raise ValueError(f"{cluster}/{w.address}: load_balancing_weight must be >= 1, got {w.weight}")
        host, port = split_hostport(w.address)
        lb.append(
            endpoint_components_pb2.LbEndpoint(
                endpoint=endpoint_components_pb2.Endpoint(
                    address=address_pb2.Address(
                        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
                    )
                ),
                health_status=_HEALTH[w.health],
                load_balancing_weight=wrappers_pb2.UInt32Value(value=w.weight),
            )
        )
    localities = [endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb)] if lb else []
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster, endpoints=localities)


def make_snapshot(messages: Mapping[str, Mapping[str, Message]]) -> Snapshot:
    """A :class:`Snapshot` from ``{type_url: {name: message}}`` (versions computed here)."""
    resources = {t: MappingProxyType({n: _resource(n, m) for n, m in ms.items()}) for t, ms in messages.items()}
    versions = {
        t: _digest(f"{n}={r.version}".encode() for n, r in sorted(rs.items())) for t, rs in resources.items()
    }
    return Snapshot(
        MappingProxyType(resources),
        MappingProxyType(versions),
        _digest(v.encode() for _, v in sorted(versions.items())),
    )


def build_snapshot(cfg: Config, weights: Iterable[EndpointWeight], ext_proc_address: str) -> Snapshot:
    """All CDS, EDS, LDS and RDS resources for ``cfg`` with the engine's ``weights`` (pure).

    ``ext_proc_address``: where Envoy reaches the picker (``HOST:PORT``, the bound address).
    """
    by_cluster: dict[str, list[EndpointWeight]] = {}
    for w in weights:
        by_cluster.setdefault(w.cluster, []).append(w)
    clusters: dict[str, Message] = {EXT_PROC_CLUSTER: build_ext_proc_cluster(ext_proc_address, cfg.envoy.tls)}
    assignments: dict[str, Message] = {}
    for service in cfg.services:
        for version in service.versions:
            name = cluster_name(service.name, version.name)
            clusters[name] = build_cluster(name, service, cfg.headers.override_host, cfg.envoy)
            assignments[name] = build_assignment(name, by_cluster.get(name, ()))
    return make_snapshot({
        CLUSTER_TYPE: clusters,
        ENDPOINT_TYPE: assignments,
        LISTENER_TYPE: {LISTENER_NAME: build_listener(cfg)},
        ROUTE_TYPE: {ROUTE_NAME: build_route_config(cfg)},
    })
