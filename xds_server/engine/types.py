"""Data the weight engine takes and returns. All immutable."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from xds_server.metrics.stats import EndpointStats

HEALTHY, UNHEALTHY, DRAINING = "HEALTHY", "UNHEALTHY", "DRAINING"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """An endpoint as configured. ``capacity``: relative to an A100 (> 0); ``memory_mib``: GPU memory;
    ``tier``: ``edge`` or ``cloud`` (EDS priority 0 or 1); ``preallocated``: its engine holds a
    preallocated KV-cache pool (its memory headroom is the KV-cache usage, not free GPU memory;
    ``VersionConfig.gpu_memory``)."""

    cluster: str
    address: str
    instance: str
    gpu_class: str
    capacity: float
    max_concurrency: int
    memory_mib: float
    draining: bool = False
    tier: str = "edge"
    preallocated: bool = False


@dataclass(frozen=True, slots=True)
class EngineParams:
    """Engine knobs (see ``xds_server.config.Engine`` for meanings and units).

    ``quantum``: weights snap to multiples of ``max(1, round(quantum x max_weight))``.
    ``max_change``: per round a weight grows at most x(1 + max_change) and shrinks at most
    /(1 + max_change) (``None``: unbounded). ``drain_timeout_s``: a draining endpoint is removed
    once its in-flight count reaches 0 or after this long (s). ``plugin_params``: ``{plugin name:
    params model}`` (a missing plugin uses its defaults). ``disabled``: filters and factors turned off.
    ``scorer_weights``: ``{scorer: weight in the mean}``; a scorer not named uses its own ``default_weight``.
    ``health_rounds``: health hysteresis (>= 1): a filter's exclusion takes effect once the endpoint was
    flagged this many rounds in a row, and an excluded endpoint comes back once it passed this many
    rounds in a row (1 = act on every round's verdict).
    """

    stale_after_s: float = 15.0
    request_memory_mib: float = 2048.0
    memory_margin: float = 0.2
    max_weight: int = 100
    hysteresis: float = 0.1
    scorer_weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    quantum: float = 0.01
    max_change: float | None = 1.0
    drain_timeout_s: float = 120.0
    plugin_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    disabled: frozenset[str] = frozenset()
    health_rounds: int = 2


_NONE: Mapping = MappingProxyType({})


class EndpointWeight(NamedTuple):
    """The engine's verdict for one endpoint.

    ``weight``: the EDS ``load_balancing_weight`` (always >= 1: exclusion is by ``health``);
    ``health``: HEALTHY, UNHEALTHY or DRAINING; ``score``: 0–1 combined score (None when excluded);
    ``scores``: per-scorer 0–1 values (None = no data); ``reasons``: human-readable why;
    ``filters``: per filter ``"pass"``, its reason, or ``"not run"``; ``factors``: per factor its
    multiplier; ``target``: the weight before the stability rules (None when excluded);
    ``removed``: a drained endpoint to leave out of the ClusterLoadAssignment.

    A named tuple, not a frozen dataclass: a round makes one per endpoint, and a frozen dataclass
    costs ~2.1 µs to construct against ~0.4 µs (``timeit``; 0.1 s a round at 60 000 endpoints).
    Change a field with ``_replace``.
    """

    cluster: str
    address: str
    weight: int
    health: str
    score: float | None
    inputs: EndpointStats
    scores: Mapping[str, float | None]
    reasons: tuple[str, ...]
    filters: Mapping[str, str] = _NONE
    factors: Mapping[str, float] = _NONE
    target: int | None = None
    removed: bool = False


@dataclass(frozen=True, slots=True)
class ClusterMemory:
    """What the engine remembers of one cluster's last round, aligned with ``addresses``: each
    endpoint's weight as decided (``decided``, ``int64``, before a uint32 fit) and whether it was
    eligible (HEALTHY and scored; ``eligible``, bool)."""

    addresses: tuple[str, ...]
    decided: np.ndarray
    eligible: np.ndarray

    def aligned(self, addresses: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``(weight, eligible)`` for ``addresses``: the decided weight (``float64``, NaN where this
        round had none) and whether it was eligible (False where unknown)."""
        if addresses == self.addresses:
            return self.decided.astype(float), self.eligible
        at = dict(zip(self.addresses, range(len(self.addresses)), strict=True))
        index = np.fromiter((at.get(a, -1) for a in addresses), dtype=np.int64, count=len(addresses))
        known = index >= 0
        weight = np.where(known, self.decided.astype(float)[index], np.nan) if len(self.addresses) else \
            np.full(len(addresses), np.nan)
        return weight, (known & self.eligible[index]) if len(self.addresses) else np.zeros(len(addresses), bool)


class _Decided(Mapping[tuple[str, str], int]):
    """``{(cluster, address): decided weight}`` over :class:`ClusterMemory` s (read-only)."""

    def __init__(self, clusters: Mapping[str, ClusterMemory]) -> None:
        self._clusters = clusters
        self._index: dict[tuple[str, str], int] | None = None

    def __getitem__(self, key: tuple[str, str]) -> int:
        if self._index is None:
            self._index = {(c, a): w for c, m in self._clusters.items()
                           for a, w in zip(m.addresses, m.decided.tolist(), strict=True)}
        return self._index[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((c, a) for c, m in self._clusters.items() for a in m.addresses)

    def __len__(self) -> int:
        return sum(len(m.addresses) for m in self._clusters.values())


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine remembers between rounds: per cluster its :class:`ClusterMemory` (the last
    weights and eligibility, in columns) and each stateful plugin's state (``plugins[cluster][name]``:
    that plugin's state for the cluster, usually ``{address: value}``; kept per cluster so a round
    hands each cluster its own without regrouping every entry). A plugin's state is the mapping the
    plugin returned: read-only by contract, never changed in place."""

    clusters: Mapping[str, ClusterMemory] = field(default_factory=lambda: MappingProxyType({}))
    plugins: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def weights(self) -> Mapping[tuple[str, str], int]:
        """``{(cluster, address): weight}`` as last decided (before a uint32 fit), read-only."""
        return _Decided(self.clusters)
