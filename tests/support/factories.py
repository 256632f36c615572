"""Small builders shared by the unit tests: configs, engine inputs, engine outputs, xDS requests."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterable, Sequence

from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from xds_server.config import Config, parse_config
from xds_server.engine.builtin import BUILTIN
from xds_server.engine.plugin import ClusterRound, Columns
from xds_server.engine.types import HEALTHY, EndpointSpec, EndpointWeight, EngineParams
from xds_server.metrics.stats import EndpointStats

#: A fresh sample age (well under the 15 s staleness limit).
FRESH_S = 1.0


def yaml_text(text: str) -> str:
    """Dedented YAML (tests write their configs indented inside the test)."""
    return textwrap.dedent(text).lstrip("\n")


def line_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based line of the ``nth`` line of ``text`` that contains ``needle``."""
    found = [i for i, line in enumerate(text.splitlines(), start=1) if needle in line]
    assert len(found) >= nth, f"{needle!r} not in the test's YAML"
    return found[nth - 1]


def config(
    services: Sequence[dict] | None = None, **sections: object
) -> Config:
    """A validated :class:`Config` from plain dicts (defaults: one service ``llm`` with 3 endpoints)."""
    import yaml

    data: dict = dict(sections)
    data["services"] = list(services) if services is not None else [service("llm", [version("v1", 3)])]
    return parse_config(yaml.safe_dump(data, sort_keys=False), "test.yaml")


def service(name: str, versions: Sequence[dict], **extra: object) -> dict:
    """One service mapping for :func:`config`."""
    return {"name": name, **extra, "versions": list(versions)}


_NEXT_NET = itertools.count(1)
_CLUSTER_NET: dict[str, int] = {}


def version(name: str, endpoints: int | Sequence[dict], subnet: int | None = None) -> dict:
    """One version mapping; ``endpoints`` is a count (unique IPs are generated) or explicit mappings."""
    if isinstance(endpoints, int):
        net = subnet if subnet is not None else next(_NEXT_NET)
        endpoints = [{"address": f"10.{net // 250}.{net % 250}.{i + 1}:8000"} for i in range(endpoints)]
    return {"name": name, "endpoints": list(endpoints)}


def spec(
    i: int,
    cluster: str = "c",
    *,
    gpu_class: str = "a100",
    capacity: float = 1.0,
    max_concurrency: int = 8,
    memory_mib: float = 81920.0,
    draining: bool = False,
    tier: str = "edge",
) -> EndpointSpec:
    """Endpoint ``i`` of ``cluster``: address ``10.0.X.Y:8000`` and the same Prometheus instance."""
    net = _CLUSTER_NET.setdefault(cluster, len(_CLUSTER_NET))
    address = f"172.{16 + net % 16}.{net // 16 * 4 + i // 250}.{i % 250 + 1}:8000"
    return EndpointSpec(cluster, address, address, gpu_class, capacity, max_concurrency, memory_mib, draining, tier)


def specs(n: int, cluster: str = "c", **kw: object) -> list[EndpointSpec]:
    """``n`` endpoints of one cluster."""
    return [spec(i, cluster, **kw) for i in range(n)]  # type: ignore[arg-type]


def stats(**kw: float | None) -> EndpointStats:
    """Stats with a fresh sample unless ``sample_age_s`` is given."""
    kw.setdefault("sample_age_s", FRESH_S)
    return EndpointStats(**kw)


def same_stats(endpoints: Iterable[EndpointSpec], **kw: float | None) -> dict[str, EndpointStats]:
    """The same stats for every endpoint, keyed by instance."""
    return {s.instance: stats(**kw) for s in endpoints}


def cluster_round(pairs: Sequence[tuple[EndpointSpec, EndpointStats]], params: EngineParams | None = None,
                  now: float = 0.0, first_round: bool = False, pool_size: int | None = None) -> ClusterRound:
    """A plugin's view of one cluster made of ``(spec, stats)`` pairs."""
    specs_, stats_ = [sp for sp, _ in pairs], [st.sanitized() for _, st in pairs]
    return ClusterRound(specs_[0].cluster if specs_ else "c", now, tuple(sp.address for sp in specs_), tuple(specs_),
                        Columns.of(specs_, stats_), len(specs_) if pool_size is None else pool_size, first_round,
                        params or EngineParams())


def filter_reason(name: str, sp: EndpointSpec, st: EndpointStats, params: EngineParams | None = None) -> str | None:
    """What filter ``name`` (default parameters) says of one endpoint alone."""
    f = BUILTIN.filters[name]
    reasons, _ = f.run(cluster_round([(sp, st)], params), f.params(), {})
    return reasons.get(sp.address)


def score(name: str, sp: EndpointSpec, st: EndpointStats, peers: Sequence[EndpointStats] = (), **params: object
          ) -> float | None:
    """Scorer ``name``'s score of ``sp`` in a pool with ``peers`` (each on its own endpoint)."""
    sc = BUILTIN.scorers[name]
    pairs = [(sp, st)] + [(spec(i + 1, sp.cluster), p) for i, p in enumerate(peers)]
    values, _ = sc.run(cluster_round(pairs), sc.params(**params), {})
    v = float(values[0])
    return None if v != v else v


def weight(cluster: str, address: str, w: int, health: str = HEALTHY) -> EndpointWeight:
    """An engine verdict, for snapshot tests."""
    return EndpointWeight(cluster, address, w, health, None, EndpointStats(), {}, ())


def request(
    type_url: str,
    names: Iterable[str] = (),
    *,
    nonce: str = "",
    version_info: str = "",
    error: str | None = None,
) -> discovery_pb2.DiscoveryRequest:
    """A SotW DiscoveryRequest as Envoy sends it (``error`` makes it a NACK)."""
    req = discovery_pb2.DiscoveryRequest(
        type_url=type_url, resource_names=list(names), response_nonce=nonce, version_info=version_info
    )
    req.node.id = "envoy-test"
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return req


def metrics_source(fetch, name: str = "fake"):
    """A ControlPlane metrics source around one blocking ``fetch(instances)`` (a test's stand-in
    for Prometheus)."""
    from types import SimpleNamespace

    from xds_server.metrics.combined import CombinedSource

    return CombinedSource([SimpleNamespace(name=name, fetch=fetch)])
