"""What an engine input is made of, independent of where samples come from.

A preset maps each :class:`~xds_server.metrics.stats.EndpointStats` field to a :class:`SignalSpec`.
The same spec is rendered to PromQL for the Prometheus source (:mod:`.promql`) and evaluated over
the control plane's own scrape windows for the scrape source (:mod:`.window`), so both sources
compute the same thing.

Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``(label, op, value)`` with op one of ``=``, ``!=``, ``=~``, ``!~`` (regexes are fully anchored, as in PromQL).
Matcher = tuple[str, str, str]
Agg = Literal["sum", "max", "min", "avg"]


@dataclass(frozen=True, slots=True)
class Sel:
    """A set of series.

    ``names``: metric (sample) names. With ``union=False`` they are fallbacks: per endpoint, the
    first name that has series is used (case C09: a renamed metric). With ``union=True`` every name
    is selected together (e.g. Triton's success + failure counters).
    ``matchers``: label matchers applied to every name.
    """

    names: tuple[str, ...]
    matchers: tuple[Matcher, ...] = ()
    union: bool = False

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("Sel needs at least one metric name")
        for _, op, _ in self.matchers:
            if op not in ("=", "!=", "=~", "!~"):
                raise ValueError(f"unknown label matcher op {op!r}")


@dataclass(frozen=True, slots=True)
class Gauge:
    """A gauge: averaged over the window (``over_window``) or its newest value, then ``agg`` over series.

    ``minus``: per-series subtraction of another gauge's newest value (e.g. total - used memory);
    only with ``over_window=False``.
    """

    sel: Sel
    agg: Agg = "sum"
    over_window: bool = True
    minus: Sel | None = None

    def __post_init__(self) -> None:
        if self.minus is not None and self.over_window:
            raise ValueError("Gauge.minus needs over_window=False")


@dataclass(frozen=True, slots=True)
class HistogramMean:
    """Mean of a histogram over the window: ``increase(X_sum) / increase(X_count)`` (0/0 = no data, C08).

    ``base``: the histogram's base names (without ``_sum``/``_count``/``_bucket``)."""

    base: Sel


@dataclass(frozen=True, slots=True)
class HistogramQuantile:
    """Quantile ``q`` (0–1) of a histogram over the window, interpolated as Prometheus' ``histogram_quantile``."""

    q: float
    base: Sel


@dataclass(frozen=True, slots=True)
class Rate:
    """Per-second rate of a counter over the window, summed over series."""

    sel: Sel


@dataclass(frozen=True, slots=True)
class Ratio:
    """``increase(num) / increase(den)`` over the window; ``den`` without increase is no data.

    ``zero_fill``: no ``num`` series counts as 0 (no 5xx yet is a 0 % error rate); off for ratios
    whose numerator must exist (a latency sum).
    """

    num: Sel
    den: Sel
    zero_fill: bool = True


@dataclass(frozen=True, slots=True)
class Total:
    """The newest value of a counter, summed over series (a cumulative count)."""

    sel: Sel


@dataclass(frozen=True, slots=True)
class SampleTime:
    """When the newest sample of ``sel`` was taken (Unix seconds)."""

    sel: Sel


@dataclass(frozen=True, slots=True)
class Plus:
    """The sum of several signals (all must have data)."""

    parts: tuple[Gauge | Total, ...]


Signal = Gauge | HistogramMean | HistogramQuantile | Rate | Ratio | Total | SampleTime | Plus


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """One engine input: ``signal`` x ``scale`` (to engine units); ``gpu``: a GPU series, joined to
    endpoints by the GPU join labels (``instance``, or ``namespace``/``pod``)."""

    signal: Signal
    scale: float = 1.0
    gpu: bool = False
