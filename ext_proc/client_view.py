"""Envoy's own view of each endpoint: latency and 5xx of the requests it reported finished.

Fed by the access-log stream the picker already consumes (:mod:`ext_proc.accesslog`): each entry
carries the upstream host, the response code and the timings as Envoy (the client side) saw them,
sub-second fresh. The control plane reads a summary per endpoint as engine inputs
(``client_latency_mean_ms``, ``client_latency_p95_ms``, ``client_error_rate``).

``record`` runs on the picker's event loop; ``summary`` may run in another thread: it copies each
deque in one C call under the GIL (no lock on the request path).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ClientView", "EndpointSummary"]


@dataclass(frozen=True, slots=True)
class EndpointSummary:
    """One endpoint over the window: ``count`` requests, ``mean_ms``/``p95_ms`` latency (ms),
    ``error_rate`` share of 5xx (0–1), ``age_s`` since the newest report (s)."""

    count: int
    mean_ms: float
    p95_ms: float
    error_rate: float
    age_s: float


class ClientView:
    """Recent finished requests per endpoint ("HOST:PORT"), kept for ``window_s`` seconds.

    ``max_per_endpoint`` bounds memory (oldest dropped first); ``clock`` is monotonic seconds.

    Raises:
        ValueError: ``window_s`` or ``max_per_endpoint`` not positive.
    """

    def __init__(self, window_s: float = 30.0, max_per_endpoint: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_per_endpoint <= 0:
            raise ValueError(f"window_s and max_per_endpoint must be > 0, got {window_s}, {max_per_endpoint}")
        self._window = window_s
        self._max = max_per_endpoint
        self._clock = clock
        self._by_endpoint: dict[str, deque[tuple[float, float, bool]]] = {}

    def record(self, endpoint: str, duration_ms: float, status: int) -> None:
        """One finished request: its total time (ms) and HTTP status as Envoy saw them."""
        if not math.isfinite(duration_ms) or duration_ms < 0:
            return
        dq = self._by_endpoint.get(endpoint)
        if dq is None:
            dq = self._by_endpoint[endpoint] = deque(maxlen=self._max)
        dq.append((self._clock(), duration_ms, status >= 500))

    def summary(self) -> dict[str, EndpointSummary]:
        """``{endpoint: EndpointSummary}`` for endpoints with reports inside the window."""
        now = self._clock()
        out = {}
        for endpoint, dq in list(self._by_endpoint.items()):
            recent = [x for x in list(dq) if now - x[0] <= self._window]
            if not recent:
                continue
            latencies = sorted(ms for _, ms, _ in recent)
            p95 = latencies[min(len(latencies) - 1, math.ceil(0.95 * len(latencies)) - 1)]
            out[endpoint] = EndpointSummary(
                count=len(recent),
                mean_ms=sum(latencies) / len(latencies),
                p95_ms=p95,
                error_rate=sum(1 for _, _, bad in recent if bad) / len(recent),
                age_s=max(0.0, now - recent[-1][0]),
            )
        return out
