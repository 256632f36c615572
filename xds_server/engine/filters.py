"""Filters: each returns the reason an endpoint must not take new traffic, or ``None``.

Pure functions of the endpoint, its stats and the engine parameters. Staleness is handled by the
pipeline because its rule is pool-wide (never every endpoint at once, case C05).
"""

from __future__ import annotations

from collections.abc import Callable

from ..metrics.stats import EndpointStats
from .types import EndpointSpec, EngineParams

Filter = Callable[[EndpointSpec, EndpointStats, EngineParams], str | None]


def is_stale(stats: EndpointStats, params: EngineParams) -> bool:
    """True when the newest sample is older than ``stale_after_s`` or was never seen (case C04)."""
    return stats.sample_age_s is None or stats.sample_age_s > params.stale_after_s


def gpu_memory(spec: EndpointSpec, stats: EndpointStats, params: EngineParams) -> str | None:
    """Excludes an endpoint whose free GPU memory can't hold a request plus the safety margin."""
    need = params.request_memory_mib * (1.0 + params.memory_margin)
    if stats.gpu_mem_free_mib is not None and stats.gpu_mem_free_mib < need:
        return f"gpu memory free {stats.gpu_mem_free_mib:.0f} MiB < {need:.0f} MiB needed (request + margin)"
    return None


def max_concurrency(spec: EndpointSpec, stats: EndpointStats, params: EngineParams) -> str | None:
    """Excludes an endpoint whose running requests (window average) reached its max concurrency."""
    if stats.running is not None and stats.running >= spec.max_concurrency:
        return f"running {stats.running:.1f} >= max concurrency {spec.max_concurrency}"
    return None


FILTERS: dict[str, Filter] = {"gpu_memory": gpu_memory, "max_concurrency": max_concurrency}
