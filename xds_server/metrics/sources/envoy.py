"""Envoy's own view of each endpoint: the requests Envoy reported finished -> the ``client_*`` inputs.

:class:`ClientView` keeps recent completions per endpoint; the app hands it to the picker as the
sink of its access-log stream (Envoy's gRPC access log: each entry carries the upstream host, the
response code and the timings as Envoy, the client side, saw them, sub-second fresh). ``record``
runs on the picker's event loop; ``summary`` may run in another thread: it copies each deque in one
C call under the GIL (no lock on the request path).

:class:`EnvoyView` turns the summary into engine inputs.

Not a source of its own in the freshest-answer merge: Envoy reporting that an endpoint answers says
nothing about the endpoint's own metrics, so it must not make a backend whose metrics stopped look
fresh (case C04). It only fills ``client_latency_mean_ms``, ``client_latency_p95_ms`` and
``client_error_rate`` of the merged statistics, when Envoy reported requests in the window.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from xds_server.metrics.stats import EndpointStats

__all__ = ["ClientView", "EndpointSummary", "EnvoyView"]


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
        """One finished request: its upstream time (ms: first byte sent upstream to last byte
        received from it, so not the time the request waited in Envoy's filters) and HTTP status as
        Envoy saw them."""
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


#: Below this many requests in the window, the client-side figures are not used. A p95 over fewer
#: than 20 requests is the slowest of them, so one stalled request (a cold connection, a busy
#: machine) would make its endpoint a latency outlier for the whole window. Envoy's own
#: success-rate outlier detection has the same kind of floor (``success_rate_request_volume``).
MIN_REQUESTS = 20


class EnvoyView:
    """Fills the ``client_*`` inputs from ``view``; ``instance_by_address``: ``{"HOST:PORT": instance}``."""

    name = "envoy"

    def __init__(self, view: ClientView, instance_by_address: Mapping[str, str]) -> None:
        self._view = view
        self._instances = dict(instance_by_address)

    def enrich(self, stats: Mapping[str, EndpointStats]) -> dict[str, EndpointStats]:
        """``stats`` with the client-side inputs of every endpoint Envoy reported on (others unchanged)."""
        out = dict(stats)
        for address, s in self._view.summary().items():
            inst = self._instances.get(address, address)   # endpoints added by a reload: instance = address
            if inst not in out or s.count < MIN_REQUESTS:
                continue
            out[inst] = replace(out[inst], client_latency_mean_ms=s.mean_ms, client_latency_p95_ms=s.p95_ms,
                                client_error_rate=s.error_rate)
        return out
