"""Config + engine weights -> one :class:`~xds_server.snapshot.Snapshot` of CDS, EDS, LDS, RDS (pure)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import Config, cluster_name
from xds_server.engine.types import EndpointWeight
from xds_server.engine.verdicts import ClusterVerdicts, Verdicts
from xds_server.resources.clusters import build_cluster, build_ext_proc_cluster, picker_limits
from xds_server.resources.endpoints import AssignmentLayout
from xds_server.resources.listener import build_listener
from xds_server.resources.names import EXT_PROC_CLUSTER, LISTENER_NAME, ROUTE_NAME
from xds_server.resources.routes import build_route_config
from xds_server.snapshot import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Resource,
    Snapshot,
    encoded_resource,
    resource,
    snapshot_of,
)


class BuildMemo:
    """What one build can reuse from the previous ones (an optimisation: output is unchanged).

    - per cluster, its :class:`~xds_server.resources.endpoints.AssignmentLayout` (the encoded
      addresses and metadata: rebuilt only when the endpoints or their config change) and its last
      assignment Resource with the weights and health it was built from: a round encodes only the
      weights and health of each cluster, and a cluster whose weights and health did not change
      keeps its Resource (not rebuilt, not re-digested);
    - per config object and picker address, the config-derived resources (clusters, listener,
      routes) and per-cluster endpoint limits: they change only when the config does.

    ``picker_metadata(cfg)``: the ``filter_metadata`` the picker's cluster carries for ``cfg``
    (``{namespace: JSON object}``; the app passes the picker's wire settings, so pickers that
    subscribe over ADS need no config of their own); None: no metadata.

    Not thread-safe: one memo per building loop.
    """

    _STATIC_ENTRIES = 8

    def __init__(self, picker_metadata: Callable[[Config], Mapping[str, Any]] | None = None) -> None:
        self._picker_metadata = picker_metadata
        self._layouts: dict[str, AssignmentLayout] = {}
        self._assignments: dict[str, tuple[AssignmentLayout, list[int], list[str], Resource]] = {}
        self._static: dict[tuple[int, str], tuple[Config, dict[str, dict], dict, dict, dict]] = {}

    def assignment(self, cluster: str, weights: ClusterVerdicts | None, limits: Mapping[str, int],
                   classes: Mapping[str, str] | None = None, tiers: Mapping[str, str] | None = None) -> Resource:
        """The assignment Resource of ``cluster`` for its verdicts ``weights`` (None: no endpoints; rebuilt
        only when they differ); ``tiers``: ``{address: "cloud"}`` of its cloud endpoints (the others are edge).

        A cluster whose every endpoint is draining gets an empty assignment: listed as DRAINING, Envoy's
        panic mode (the service's ``panic_threshold_percent`` above 0, when fewer hosts than that are
        healthy) would still send them new requests until they are removed; withdrawn, Envoy answers
        503 ``no healthy upstream`` at once, and the requests in flight finish on their connections
        (Envoy drains a removed host's connection pools). One healthy endpoint left: listed as they are."""
        if weights is not None and weights.all_draining():
            weights = None
        addresses = weights.addresses if weights is not None else ()
        layout = self._layout(cluster, addresses, limits, classes or {}, tiers or {})
        values, health = (weights.weight.tolist(), weights.health_names()) if weights is not None else ([], [])
        hit = self._assignments.get(cluster)
        if hit is not None and hit[0] is layout and hit[1] == values and hit[2] == health:
            return hit[3]
        data = layout.encode(values, health)
        res = encoded_resource(cluster, endpoint_pb2.ClusterLoadAssignment, data)
        self._assignments[cluster] = (layout, values, health, res)
        return res

    def _layout(self, cluster: str, addresses: tuple[str, ...], limits: Mapping[str, int], classes: Mapping[str, str],
                tiers: Mapping[str, str]) -> AssignmentLayout:
        """The cluster's layout, the last one when its addresses and their config are the same (the
        config's maps are compared by identity first: the same config object gives the same maps)."""
        inputs = (limits, classes, tiers)
        old = self._layouts.get(cluster)
        if old is not None and old.addresses == addresses and all(
                a is b or a == b for a, b in zip(old.inputs, inputs, strict=True)):
            return old
        layout = self._layouts[cluster] = AssignmentLayout(cluster, addresses, limits, classes, tiers, previous=old)
        return layout

    def static(self, cfg: Config, ext_proc_address: str
               ) -> tuple[dict[str, dict[str, Resource]], dict, dict, dict]:
        """CDS, LDS and RDS resources of ``cfg``, ``{cluster: {address: max_concurrency}}``,
        ``{cluster: {address: gpu_class}}`` and ``{cluster: {address: "cloud"}}`` (the cloud-tier
        endpoints; the config object itself is the key, by identity)."""
        key = (id(cfg), ext_proc_address)
        hit = self._static.get(key)
        if hit is not None and hit[0] is cfg:
            return hit[1], hit[2], hit[3], hit[4]
        metadata = self._picker_metadata(cfg) if self._picker_metadata is not None else None
        n_clusters = sum(len(s.versions) for s in cfg.services)
        ext_proc = build_ext_proc_cluster(ext_proc_address, metadata, cfg.envoy.tls,
                                          picker_limits(cfg.envoy, n_clusters))
        clusters = {EXT_PROC_CLUSTER: resource(EXT_PROC_CLUSTER, ext_proc)}
        limits: dict[str, dict[str, int]] = {}
        classes: dict[str, dict[str, str]] = {}
        tiers: dict[str, dict[str, str]] = {}
        for service in cfg.services:
            for version in service.versions:
                name = cluster_name(service.name, version.name)
                tiers[name] = {e.address: e.tier for e in version.endpoints if e.tier != "edge"}
                clusters[name] = resource(name, build_cluster(name, service, cfg.headers.override_host, cfg.envoy,
                                                              tiered=bool(tiers[name])))
                limits[name] = {e.address: e.max_concurrency for e in version.endpoints}
                classes[name] = {e.address: e.gpu_class for e in version.endpoints}
        built = {
            CLUSTER_TYPE: clusters,
            LISTENER_TYPE: {LISTENER_NAME: resource(LISTENER_NAME, build_listener(cfg))},
            ROUTE_TYPE: {ROUTE_NAME: resource(ROUTE_NAME, build_route_config(cfg))},
        }
        if len(self._static) >= self._STATIC_ENTRIES:
            self._static.pop(next(iter(self._static)))
        self._static[key] = (cfg, built, limits, classes, tiers)
        return built, limits, classes, tiers


def build_snapshot(cfg: Config, weights: Iterable[EndpointWeight], ext_proc_address: str,
                   memo: BuildMemo | None = None) -> Snapshot:
    """All CDS, EDS, LDS and RDS resources for ``cfg`` with the engine's ``weights`` (pure).

    ``ext_proc_address``: where Envoy reaches the picker (``HOST:PORT``, the bound address).
    ``memo``: reuse unchanged resources from earlier builds (same result, less CPU); weights of
    clusters that ``cfg`` does not configure are ignored, and a configured cluster without weights
    gets an empty assignment.
    """
    memo = memo or BuildMemo()
    by_cluster = {part.cluster: part for part in Verdicts.of(weights).parts}
    static, limits, classes, tiers = memo.static(cfg, ext_proc_address)
    assignments = {
        name: memo.assignment(name, by_cluster.get(name), limits[name], classes[name], tiers[name])
        for name in static[CLUSTER_TYPE] if name != EXT_PROC_CLUSTER
    }
    return snapshot_of({
        CLUSTER_TYPE: static[CLUSTER_TYPE],
        ENDPOINT_TYPE: assignments,
        LISTENER_TYPE: static[LISTENER_TYPE],
        ROUTE_TYPE: static[ROUTE_TYPE],
    })
