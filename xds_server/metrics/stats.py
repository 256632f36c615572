"""Per-endpoint statistics over the sliding window: the weight engine's input."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """What the metrics sources saw for one endpoint; ``None`` means "no data" (never 0).

    Units and meaning (window = the sources' sliding window):

    - ``latency_mean_ms``, ``latency_p95_ms``: end-to-end latency over the window, ms.
    - ``itl_mean_ms``: inter-token latency (time between two output tokens of a request, i.e. one
      decode step at the batch the request ran in) over the window, ms.
    - ``queue``, ``running``: requests waiting / running, window averages (a pushed value is the latest).
    - ``in_flight``: requests running + waiting at the newest sample (not averaged; drain uses it).
    - ``gpu_util``: 0–1, the busiest GPU of the endpoint. ``gpu_mem_free_mib`` (the GPU with the least
      free) and ``gpu_mem_used_mib`` (the most used): MiB. ``kv_cache``: KV-cache usage 0–1.
    - ``request_rate``: finished requests per second over the window.
    - ``error_rate``: 0–1, share of requests answered with a 5xx (an OOM is one) over the window.
    - ``success_total``, ``oom_total``: cumulative counters (requests served, requests refused for
      lack of GPU memory); plugins that need "since" compare them across rounds.
    - ``client_latency_mean_ms``, ``client_latency_p95_ms``, ``client_error_rate``: the same as seen
      by Envoy (its access-log stream), when such a source is plugged in; ``None`` otherwise.
    - ``sample_age_s``: age of the newest sample, s (``None``: never seen).
    """

    latency_mean_ms: float | None = None
    latency_p95_ms: float | None = None
    itl_mean_ms: float | None = None
    queue: float | None = None
    running: float | None = None
    in_flight: float | None = None
    gpu_util: float | None = None
    gpu_mem_free_mib: float | None = None
    gpu_mem_used_mib: float | None = None
    kv_cache: float | None = None
    request_rate: float | None = None
    error_rate: float | None = None
    success_total: float | None = None
    oom_total: float | None = None
    client_latency_mean_ms: float | None = None
    client_latency_p95_ms: float | None = None
    client_error_rate: float | None = None
    sample_age_s: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        """The fields as a JSON-ready dict, values rounded to 3 decimals (see :func:`as_dicts`)."""
        return as_dicts([self])[0]

    def sanitized(self) -> EndpointStats:
        """The same stats with every NaN/±Inf/non-number replaced by ``None`` (no data, case C08).

        Fast path (runs per endpoint per round): a finite float or an int passes without a call."""
        bad = None
        for name, v in zip(STAT_FIELDS, _ALL(self), strict=True):
            if v is None or (type(v) is float and v - v == 0.0) or type(v) is int:
                continue
            if finite(v) is None:
                bad = bad or {}
                bad[name] = None
        return replace(self, **bad) if bad else self


#: Every field of :class:`EndpointStats`, in declaration order.
STAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EndpointStats))
_ALL = operator.attrgetter(*STAT_FIELDS)
_GETTERS = tuple(operator.attrgetter(name) for name in STAT_FIELDS)

#: Every signal field (all but ``sample_age_s``), in declaration order.
SIGNAL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EndpointStats) if f.name != "sample_age_s")


def rounded(values: Sequence[float | None], digits: int) -> list[float | None]:
    """``values`` rounded to ``digits`` decimals in one numpy operation (``numpy.round``: x·10^digits
    rounded half to even; Python's ``round`` costs ~0.5 µs a value, 20x more); None stays None."""
    if not values:
        return []
    out = np.round(np.array(values, dtype=float), digits).tolist()
    if None in values:
        out = [None if v is None else r for v, r in zip(values, out, strict=True)]
    return out


def stats_matrix(stats: Sequence[EndpointStats]) -> np.ndarray:
    """``stats`` as one ``float64`` array of shape ``(len(stats), len(STAT_FIELDS))``: row ``i`` holds
    ``stats[i]``'s fields in :data:`STAT_FIELDS` order, NaN where a field is None.

    Filled :data:`MATRIX_PIECE` rows at a time: one ``numpy.array`` over 60 000 rows is one C call
    holding the GIL for ~50 ms (measured in the history writer thread), which the event loop shares."""
    out = np.empty((len(stats), len(STAT_FIELDS)))
    for start in range(0, len(stats), MATRIX_PIECE):
        piece = stats[start:start + MATRIX_PIECE]
        out[start:start + len(piece)] = np.array([_ALL(s) for s in piece], dtype=float).reshape(len(piece), -1)
    return out


#: Rows per ``numpy.array`` call in :func:`stats_matrix`.
MATRIX_PIECE = 2048


def as_dicts(stats: Sequence[EndpointStats]) -> list[dict[str, float | None]]:
    """:meth:`EndpointStats.as_dict` of each of ``stats``, field by field over all of them at once
    (a round's history rows at 60 000 endpoints: ~1 M values)."""
    columns = [rounded(list(map(getter, stats)), 3) for getter in _GETTERS]
    return [dict(zip(STAT_FIELDS, row, strict=True)) for row in zip(*columns, strict=True)]


def finite(value: object) -> float | None:
    """``value`` as a float, or ``None`` for NaN, ±Inf or anything unparsable (case C08: 0/0 = no data)."""
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None
