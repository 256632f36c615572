"""Which clusters Envoy cannot serve: no healthy endpoint left, including none left at all."""

from __future__ import annotations

from xds_server.engine.types import EndpointWeight
from xds_server.engine.verdicts import Verdicts, unserved
from xds_server.metrics.stats import EndpointStats


def _w(cluster: str, address: str, health: str, removed: bool = False) -> EndpointWeight:
    return EndpointWeight(cluster, address, 1, health, None, EndpointStats(), {}, (), removed=removed)


def test_a_cluster_whose_every_endpoint_was_removed_is_unserved():
    """Drained until idle and removed: Envoy has no host to send to, so the cluster is still unserved
    (before, it read as served again once its last endpoint was removed)."""
    weights = [_w("a", "10.0.0.1:1", "DRAINING", removed=True),
               _w("b", "10.0.0.2:1", "DRAINING", removed=True), _w("b", "10.0.0.3:1", "HEALTHY"),
               _w("c", "10.0.0.4:1", "DRAINING"), _w("c", "10.0.0.5:1", "DRAINING", removed=True),
               _w("d", "10.0.0.6:1", "DRAINING"), _w("d", "10.0.0.7:1", "UNHEALTHY")]
    assert unserved(Verdicts.of(weights)) == {
        "a": "every endpoint was removed (drained, or gone)",
        "c": "every endpoint is draining",
        "d": "no endpoint is healthy (1 draining, 1 unhealthy)",
    }
