"""``latency_outlier``: ejects an endpoint whose latency over the window is far above its peers'.

An endpoint is an outlier when its latency (``signal``: ``p95`` or ``mean``; Envoy's client-side
view when a source provides it, else the backend's) is more than ``factor`` x the median of the
other judged endpoints and at least ``min_delta_ms`` above it. With ``normalize_by_capacity`` each
latency is multiplied by the endpoint's GPU-class capacity first, so an A10 that is as slow as an
A10 should be is not an outlier next to A100s. Endpoints with a known request rate below
``min_request_rate`` (req/s) are not judged (too few samples). A pool with fewer than ``min_hosts``
judged endpoints is not judged at all: next to one or two peers, "far above the peers' median" is
"busier than the other one" (more sessions pinned there, a longer queue), not a slow node; Envoy's
success-rate outlier detection has the same floor (``success_rate_minimum_hosts``, default 5, in
https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/outlier_detection.proto).
Ejection times, their growth with
repeats and ``max_ejection_percent`` follow :mod:`..ejection` (Envoy's outlier-detection rules).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import Field

from tests.support.reference_engine.ejection import EjectionParams, eject
from tests.support.reference_engine.inputs import latency_of
from tests.support.reference_engine.plugin import ClusterRound, Filter, State


class Params(EjectionParams):
    """See the module docstring."""

    signal: Literal["p95", "mean"] = "p95"
    factor: float = Field(3.0, gt=1)
    min_delta_ms: float = Field(50.0, ge=0)
    min_request_rate: float = Field(0.0, ge=0)
    min_hosts: int = Field(3, ge=2)
    normalize_by_capacity: bool = True


def median_without(ordered: Sequence[float], i: int) -> float:
    """The median of sorted ``ordered`` without its element at index ``i``, in O(1) (the peers'
    median of each endpoint without an O(n) copy each: a 60 000-endpoint round stays O(n log n)).

    >>> median_without([1, 2, 3, 10], 3), median_without([1, 2, 3, 10], 0), median_without([1, 5, 9], 1)
    (2, 3, 5.0)
    """
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    judged: dict[str, float] = {}
    for m in rnd.members:
        v = latency_of(m, p.signal)
        rate = m.stats.request_rate
        if v is None or (rate is not None and rate < p.min_request_rate):
            continue
        v *= m.spec.capacity if p.normalize_by_capacity else 1.0
        if v > 0 and math.isfinite(v):
            judged[m.address] = v
    outliers: dict[str, tuple[float, str]] = {}
    ordered = sorted(judged.values())
    rank = {a: bisect.bisect_left(ordered, v) for a, v in judged.items()}
    for address, v in judged.items():
        if len(ordered) < p.min_hosts:
            break
        ref = median_without(ordered, rank[address])
        if ref > 0 and v > p.factor * ref and v - ref >= p.min_delta_ms:
            unit = " (capacity-normalised)" if p.normalize_by_capacity else ""
            outliers[address] = (v / ref, f"{p.signal} latency {v:.0f} ms > {p.factor:g} x peers' median "
                                          f"{ref:.0f} ms{unit}")
    return eject(rnd, p, state, outliers, "latency outlier")


PLUGIN = Filter("latency_outlier", Params, _run)
