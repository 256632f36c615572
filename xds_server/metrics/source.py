"""What a metrics source is: the protocols the control plane reads statistics through, and its one error."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from xds_server.metrics.stats import EndpointStats


class MetricsUnavailable(RuntimeError):
    """A source could not produce a round of statistics (Prometheus down, slow or answering garbage)."""


class PullSource(Protocol):
    """A source asked once per round. ``fetch`` raises MetricsUnavailable when it cannot answer."""

    name: str

    def fetch(self, instances: Iterable[str]) -> dict[str, EndpointStats]: ...


class MetricsSource(Protocol):
    """What the control plane needs: a current ``name``, a blocking ``fetch`` and a ``describe()``."""

    @property
    def name(self) -> str: ...

    def fetch(self, instances: Iterable[str]) -> dict[str, EndpointStats]: ...

    def describe(self) -> dict: ...
