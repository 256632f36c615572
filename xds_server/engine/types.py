"""Data the weight engine takes and returns. All immutable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..metrics.stats import EndpointStats

HEALTHY, UNHEALTHY, DRAINING = "HEALTHY", "UNHEALTHY", "DRAINING"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """An endpoint as configured. ``capacity``: relative to an A100 (> 0); ``memory_mib``: GPU memory."""

    cluster: str
    address: str
    instance: str
    gpu_class: str
    capacity: float
    max_concurrency: int
    memory_mib: float
    draining: bool = False


@dataclass(frozen=True, slots=True)
class EngineParams:
    """Engine knobs (see ``xds_server.config.Engine`` for meanings and units)."""

    stale_after_s: float = 15.0
    request_memory_mib: float = 2048.0
    memory_margin: float = 0.2
    max_weight: int = 100
    hysteresis: float = 0.1
    scorer_weights: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({"idle_compute": 1.0, "concurrency": 1.0, "latency": 1.0})
    )


@dataclass(frozen=True, slots=True)
class EndpointWeight:
    """The engine's verdict for one endpoint.

    ``weight``: the EDS ``load_balancing_weight`` (always >= 1: exclusion is by ``health``);
    ``health``: HEALTHY, UNHEALTHY or DRAINING; ``score``: 0–1 combined score (None when excluded);
    ``scores``: per-scorer 0–1 values (None = no data); ``reasons``: human-readable why.
    """

    cluster: str
    address: str
    weight: int
    health: str
    score: float | None
    inputs: EndpointStats
    scores: Mapping[str, float | None]
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine remembers between rounds: the last weight per ``(cluster, address)``."""

    weights: Mapping[tuple[str, str], int] = field(default_factory=lambda: MappingProxyType({}))
