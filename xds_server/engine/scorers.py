"""Scorers: each returns a score in [0, 1] for one endpoint (1 = best), or ``None`` for "no data".

``pool`` is the list of stats of the endpoints still eligible in the same cluster, for scorers that
rank an endpoint against its peers. All bounded: no scorer can return more than 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..metrics.stats import EndpointStats
from .types import EndpointSpec

Scorer = Callable[[EndpointSpec, EndpointStats, Sequence[EndpointStats]], float | None]


def _clamp(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def idle_compute(spec: EndpointSpec, stats: EndpointStats, pool: Sequence[EndpointStats]) -> float | None:
    """``1 - GPU utilisation`` (0–1)."""
    return None if stats.gpu_util is None else _clamp(1.0 - stats.gpu_util)


def concurrency(spec: EndpointSpec, stats: EndpointStats, pool: Sequence[EndpointStats]) -> float | None:
    """Concurrency headroom: ``1 - (running + queue) / max_concurrency`` (0–1)."""
    if stats.running is None:
        return None
    return _clamp(1.0 - (stats.running + (stats.queue or 0.0)) / spec.max_concurrency)


def latency(spec: EndpointSpec, stats: EndpointStats, pool: Sequence[EndpointStats]) -> float | None:
    """Mean latency relative to the pool's best: ``best / own`` (0–1], never unbounded."""
    own = stats.latency_mean_ms
    peers = [s.latency_mean_ms for s in pool if s.latency_mean_ms is not None and s.latency_mean_ms > 0]
    if own is None or own <= 0 or not peers:
        return None
    return _clamp(min(peers) / own)


SCORERS: dict[str, Scorer] = {"idle_compute": idle_compute, "concurrency": concurrency, "latency": latency}
