"""What several plugins read off one endpoint the same way: free GPU memory, a request's need, latency."""

from __future__ import annotations

from tests.support.reference_engine.plugin import ClusterRound, Member


def free_mib(m: Member) -> float | None:
    """Free GPU memory of ``m`` in MiB, or ``None`` when unknown."""
    if m.stats.gpu_mem_free_mib is not None:
        return m.stats.gpu_mem_free_mib
    if m.stats.gpu_mem_used_mib is not None:
        return max(0.0, m.spec.memory_mib - m.stats.gpu_mem_used_mib)
    return None


def needed_mib(rnd: ClusterRound) -> float:
    """Memory one request needs including the margin, MiB."""
    return rnd.engine.request_memory_mib * (1.0 + rnd.engine.memory_margin)


def latency_of(m: Member, signal: str) -> float | None:
    """The latency ``m`` is judged by (ms): Envoy's view when known, else the backend's; ``None`` = no data."""
    s = m.stats
    if signal == "p95":
        v = s.client_latency_p95_ms if s.client_latency_p95_ms is not None else s.latency_p95_ms
    else:
        v = s.client_latency_mean_ms if s.client_latency_mean_ms is not None else s.latency_mean_ms
    return v if v is not None and v > 0 else None
