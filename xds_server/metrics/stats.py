"""Per-endpoint statistics over the sliding window: the weight engine's input."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """What the metrics source saw for one endpoint; ``None`` means "no data" (never 0).

    Units: latencies in ms; ``queue`` and ``running`` in requests (window averages);
    ``gpu_util`` and ``kv_cache`` as 0–1; GPU memory in MiB; ``sample_age_s`` is the age of the
    newest sample in seconds (``None``: never seen).
    """

    latency_mean_ms: float | None = None
    latency_p95_ms: float | None = None
    queue: float | None = None
    running: float | None = None
    gpu_util: float | None = None
    gpu_mem_free_mib: float | None = None
    gpu_mem_used_mib: float | None = None
    kv_cache: float | None = None
    sample_age_s: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        """The fields as a JSON-ready dict, values rounded to 3 decimals."""
        return {
            name: (None if (v := getattr(self, name)) is None else round(v, 3))
            for name in self.__slots__  # type: ignore[attr-defined]
        }


def finite(value: object) -> float | None:
    """``value`` as a float, or ``None`` for NaN, ±Inf or anything unparsable (case C08: 0/0 = no data)."""
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
