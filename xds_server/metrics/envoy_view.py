"""Envoy's own view of each endpoint (the picker's access-log completions) -> the ``client_*`` inputs.

Not a source of its own in the freshest-answer merge: Envoy reporting that an endpoint answers says
nothing about the endpoint's own metrics, so it must not make a backend whose metrics stopped look
fresh (case C04). It only fills ``client_latency_mean_ms``, ``client_latency_p95_ms`` and
``client_error_rate`` of the merged statistics, when Envoy reported requests in the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ext_proc.client_view import ClientView

from xds_server.metrics.stats import EndpointStats

#: Below this many requests in the window, the client-side figures are too noisy to use.
MIN_REQUESTS = 3


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
