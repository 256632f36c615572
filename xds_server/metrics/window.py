"""Evaluate a :class:`~xds_server.metrics.signals.Signal` over a window of scrapes of one endpoint (pure).

The scrape source's counterpart of :mod:`.promql`: the same definitions, computed from the samples
the control plane scraped itself. Semantics follow Prometheus where it matters: counters may reset
(a drop restarts the count), a rate needs two samples, 0/0 is no data (C08), and quantiles are
interpolated linearly inside the bucket as ``histogram_quantile`` does
(https://prometheus.io/docs/prometheus/latest/querying/functions/#histogram_quantile).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from xds_server.metrics.signals import (
    Gauge,
    HistogramMean,
    HistogramQuantile,
    Plus,
    Rate,
    Ratio,
    SampleTime,
    Sel,
    Signal,
    Total,
)

#: A series' labels, sorted: ``(("gpu", "0"), ("model_name", "m"))``.
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One successful scrape of one endpoint: ``t`` (Unix s) and ``{sample name: ((labels, value), ...)}``."""

    t: float
    samples: Mapping[str, tuple[tuple[Labels, float], ...]]


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _match(labels: Labels, matchers: Iterable[tuple[str, str, str]], required: Mapping[str, str]) -> bool:
    d = dict(labels)
    for k, v in required.items():
        # Prometheus renames a scraped label that clashes with a target label to exported_<name>
        # (dcgm-exporter's pod/namespace on Kubernetes); when present it is the one that names the
        # GPU's workload, as in the PromQL this mirrors (xds_server.metrics.promql.exported_labels).
        if (d.get(f"exported_{k}") or d.get(k, "")) != v:
            return False
    for label, op, value in matchers:
        have = d.get(label, "")
        if op == "=" and have != value or op == "!=" and have == value:
            return False
        if op in ("=~", "!~") and (_regex(value).fullmatch(have) is not None) != (op == "=~"):
            return False
    return True


def _names(sel: Sel, scrapes: Sequence[Scrape], suffix: str) -> list[str]:
    """The names ``sel`` reads in this window: all of them (union), or the first that has series (fallback)."""
    if sel.union:
        return [n + suffix for n in sel.names]
    for name in sel.names:
        if any(s.samples.get(name + suffix) for s in scrapes):
            return [name + suffix]
    return []


def _series(scrape: Scrape, names: Iterable[str], sel: Sel, required: Mapping[str, str]) -> dict[Labels, float]:
    """``{(("__name__", name), *labels): value}`` of the matching series in one scrape."""
    out: dict[Labels, float] = {}
    every = not sel.matchers and not required  # no label to check: each series matches
    for name in names:
        for labels, value in scrape.samples.get(name, ()):
            if every or _match(labels, sel.matchers, required):
                key = (("__name__", name), *labels)
                out[key] = out.get(key, 0.0) + value
    return out


def _increases(scrapes: Sequence[Scrape], sel: Sel, suffix: str,
               required: Mapping[str, str]) -> tuple[dict[Labels, float], int]:
    """Per series, the counter increase over the window (resets counted as Prometheus does);
    also how many scrapes had any of the series."""
    names = _names(sel, scrapes, suffix)
    last: dict[Labels, float] = {}
    inc: dict[Labels, float] = {}
    seen = 0
    for s in scrapes:
        values = _series(s, names, sel, required)
        seen += bool(values)
        for key, v in values.items():
            if key in last:
                prev = last[key]
                inc[key] = inc.get(key, 0.0) + (v - prev if v >= prev else v)
            else:
                inc.setdefault(key, 0.0)
            last[key] = v
    return inc, seen


def _agg(values: Sequence[float], agg: str) -> float | None:
    if not values:
        return None
    if agg == "sum":
        return sum(values)
    if agg == "max":
        return max(values)
    if agg == "min":
        return min(values)
    return sum(values) / len(values)


def _gauge(g: Gauge, scrapes: Sequence[Scrape], required: Mapping[str, str]) -> float | None:
    names = _names(g.sel, scrapes, "")
    if not names:
        return None
    if not g.over_window:
        newest = next((s for s in reversed(scrapes) if _series(s, names, g.sel, required)), None)
        if newest is None:
            return None
        values = _series(newest, names, g.sel, required)
        if g.minus is not None:
            other = _series(newest, _names(g.minus, [newest], ""), g.minus, required)
            strip = {tuple(kv for kv in k if kv[0] != "__name__"): v for k, v in other.items()}
            diffs = [v - strip[k2] for k, v in values.items()
                     if (k2 := tuple(kv for kv in k if kv[0] != "__name__")) in strip]
            return _agg(diffs, g.agg)
        return _agg(list(values.values()), g.agg)
    sums: dict[Labels, list[float]] = {}
    for s in scrapes:
        for key, v in _series(s, names, g.sel, required).items():
            sums.setdefault(key, []).append(v)
    return _agg([sum(v) / len(v) for v in sums.values()], g.agg)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` on ``[(upper bound, cumulative count)]``; ``None`` where it gives NaN.

    Needs at least two buckets and a ``+Inf`` bucket; the lowest bucket starts at 0 (if its bound
    is positive); a rank in the ``+Inf`` bucket gives the highest finite bound.
    """
    if not 0.0 <= q <= 1.0 or len(buckets) < 2:
        return None
    bs = sorted(buckets)
    if not math.isinf(bs[-1][0]):
        return None
    counts: list[float] = []
    for _, c in bs:  # enforce monotonicity, as Prometheus does for scrapes taken mid-update
        counts.append(max(c, counts[-1]) if counts else c)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(bs) - 1:
        return bs[-2][0]
    end = bs[i][0]
    if i == 0:
        start, below = (0.0 if end > 0 else end), 0.0
    else:
        start, below = bs[i - 1][0], counts[i - 1]
    in_bucket = counts[i] - below
    if in_bucket <= 0:
        return end
    return start + (end - start) * (rank - below) / in_bucket


def evaluate(signal: Signal, scrapes: Sequence[Scrape], required: Mapping[str, str] | None = None) -> float | None:
    """``signal`` over ``scrapes`` (oldest first, already cut to the window); ``None`` = no data.

    ``required``: labels every series must carry (the pod/namespace join of GPU series); ``None`` = any.
    """
    req = required or {}
    if not scrapes:
        return None
    if isinstance(signal, Gauge):
        return _gauge(signal, scrapes, req)
    if isinstance(signal, HistogramMean):
        s, n = _increases(scrapes, signal.base, "_sum", req)
        c, m = _increases(scrapes, signal.base, "_count", req)
        count = sum(c.values())
        return sum(s.values()) / count if min(n, m) >= 2 and count > 0 else None
    if isinstance(signal, HistogramQuantile):
        inc, n = _increases(scrapes, signal.base, "_bucket", req)
        if n < 2:
            return None
        by_le: dict[float, float] = {}
        for key, v in inc.items():
            le = dict(key).get("le")
            if le is None:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            by_le[bound] = by_le.get(bound, 0.0) + v
        return histogram_quantile(signal.q, list(by_le.items()))
    if isinstance(signal, Rate):
        inc, n = _increases(scrapes, signal.sel, "", req)
        span = scrapes[-1].t - scrapes[0].t
        return sum(inc.values()) / span if n >= 2 and span > 0 and inc else None
    if isinstance(signal, Ratio):
        den, n = _increases(scrapes, signal.den, "", req)
        num, n_num = _increases(scrapes, signal.num, "", req)
        d = sum(den.values())
        if n < 2 or d <= 0 or (not signal.zero_fill and n_num < 2):
            return None
        return sum(num.values()) / d
    if isinstance(signal, Total):
        names = _names(signal.sel, scrapes, "")
        newest = next((s for s in reversed(scrapes) if _series(s, names, signal.sel, req)), None)
        return None if newest is None else sum(_series(newest, names, signal.sel, req).values())
    if isinstance(signal, SampleTime):
        names = _names(signal.sel, scrapes, "")
        return next((s.t for s in reversed(scrapes) if _series(s, names, signal.sel, req)), None)
    if isinstance(signal, Plus):
        parts = [evaluate(p, scrapes, required) for p in signal.parts]
        return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]
    raise TypeError(f"not a signal: {signal!r}")
