"""Render a :class:`~xds_server.metrics.signals.Signal` as PromQL (pure).

Every query returns one series per join key (``by``, e.g. ``("instance",)``) so results join to
endpoints. ``{w}`` in the result stands for the window (``60s``); the source substitutes it.
Fallback names become PromQL ``or`` (per join key, the first alternative that has series: C09).
Metric names with colons need no quoting (quoted names fail on Prometheus 2.42).
"""

from __future__ import annotations

import json
from collections.abc import Callable

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


def _matchers(sel: Sel, extra: tuple[tuple[str, str, str], ...] = ()) -> list[str]:
    return [f"{label}{op}{json.dumps(value)}" for label, op, value in (*extra, *sel.matchers)]


def selectors(sel: Sel, suffix: str = "") -> list[str]:
    """The PromQL selectors of ``sel``, one per name."""
    out = []
    for name in sel.names:
        m = _matchers(sel)
        out.append(f"{name}{suffix}" + ("{" + ",".join(m) + "}" if m else ""))
    return out


def _alternatives(sel: Sel, fn: Callable[[Callable[[str], str]], str], agg: str, k: str) -> str:
    """``fn(select)`` per name of ``sel`` (``select(suffix)`` gives that name's selector).

    Fallback names are joined with ``or`` (per join key the first that has series). A union is
    combined with ``agg by (k)``; each part gets a distinct ``inferlb_part`` label first, because
    ``or`` would drop parts whose label sets match and a multi-name ``rate()`` fails on Prometheus 2
    ("vector cannot contain metrics with the same labelset").
    """
    parts = []
    for name in sel.names:
        one = Sel((name,), sel.matchers)
        parts.append(fn(lambda suffix, one=one: selectors(one, suffix)[0]))
    if len(parts) == 1:
        return parts[0]
    if not sel.union:
        return " or ".join(f"({p})" for p in parts)
    tagged = " or ".join(f'label_replace({p}, "inferlb_part", "{i}", "", "")' for i, p in enumerate(parts))
    return f"{agg} by ({k}) ({tagged})"


def exported_labels(expr: str, by: tuple[str, ...]) -> str:
    """``expr`` with each label of ``by`` taken from ``exported_<label>`` where that is set.

    Prometheus renames a scraped label that clashes with a target label to ``exported_<label>``
    (with ``honor_labels: false``, its default): on Kubernetes dcgm-exporter's ``pod`` and
    ``namespace`` (the GPU's workload) arrive as ``exported_pod`` / ``exported_namespace`` while
    ``pod`` names the exporter's own pod. Joined by ``instance`` nothing changes.

    >>> exported_labels("m", ("pod",))
    'label_replace(m, "pod", "$1", "exported_pod", "(.+)")'
    """
    if by == ("instance",):
        return expr
    for label in by:
        expr = f'label_replace({expr}, "{label}", "$1", "exported_{label}", "(.+)")'
    return expr


def render(signal: Signal, by: tuple[str, ...]) -> str:
    """PromQL for ``signal`` grouped by the labels ``by`` (window placeholder ``{w}``)."""
    k = ", ".join(by)
    if isinstance(signal, Gauge):
        def gauge(select: Callable[[str], str]) -> str:
            if signal.over_window:
                inner = f"avg_over_time({select('')}[{{w}}])"
            elif signal.minus is not None:
                inner = f"{select('')} - {selectors(signal.minus)[0]}"
            else:
                inner = select("")
            return f"{signal.agg} by ({k}) ({exported_labels(inner, by)})"
        return _alternatives(signal.sel, gauge, signal.agg, k)
    if isinstance(signal, HistogramMean | HistogramQuantile) and signal.base.union:
        raise ValueError("a histogram signal takes fallback names, not a union")
    if isinstance(signal, HistogramMean):
        return _alternatives(signal.base, lambda s: f"sum by ({k}) (rate({s('_sum')}[{{w}}]))"
                                                    f" / sum by ({k}) (rate({s('_count')}[{{w}}]))", "sum", k)
    if isinstance(signal, HistogramQuantile):
        return _alternatives(signal.base, lambda s: f"histogram_quantile({signal.q:g}, "
                                                    f"sum by (le, {k}) (rate({s('_bucket')}[{{w}}])))", "sum", k)

    def rate(s: Callable[[str], str]) -> str:
        return f"sum by ({k}) (rate({s('')}[{{w}}]))"

    if isinstance(signal, Rate):
        return _alternatives(signal.sel, rate, "sum", k)
    if isinstance(signal, Ratio):
        den = _alternatives(signal.den, rate, "sum", k)
        num = _alternatives(signal.num, rate, "sum", k)
        if not signal.zero_fill:
            return f"({num}) / ({den})"
        # No numerator series yet (e.g. no 5xx ever) is 0, not "no data": fill it with 0 x den.
        return f"(({num}) or (0 * ({den}))) / ({den})"
    if isinstance(signal, Total):
        return _alternatives(signal.sel, lambda s: f"sum by ({k}) ({s('')})", "sum", k)
    if isinstance(signal, SampleTime):
        return _alternatives(signal.sel, lambda s: f"max by ({k}) (timestamp({s('')}))", "max", k)
    if isinstance(signal, Plus):
        return " + ".join(f"({render(p, by)})" for p in signal.parts)
    raise TypeError(f"not a signal: {signal!r}")
