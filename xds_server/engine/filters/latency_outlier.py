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

In a cluster with edge and cloud tiers an endpoint's peers are the endpoints of its own tier (and
``min_hosts`` counts per tier): the picker keeps the edge near its spill threshold and the cloud
mostly idle by design, so an edge node is always slower than the cloud's median without being
slow (seen in the ``edge_cloud`` benchmark: a loaded edge A10 ejected next to idle A100s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import Field

from xds_server.engine.ejection import EjectionParams, eject
from xds_server.engine.inputs import latency_of
from xds_server.engine.plugin import Array, ClusterRound, Filter, State


class Params(EjectionParams):
    """See the module docstring."""

    signal: Literal["p95", "mean"] = "p95"
    factor: float = Field(3.0, gt=1)
    min_delta_ms: float = Field(50.0, ge=0)
    min_request_rate: float = Field(0.0, ge=0)
    min_hosts: int = Field(3, ge=2)
    normalize_by_capacity: bool = True


def peers_median(ordered: Array, rank: Array) -> Array:
    """For each ``rank[j]``, the median of sorted ``ordered`` without its element at that index, in
    O(1) each (the peers' median of each endpoint without an O(n) copy each: a 60 000-endpoint round
    stays O(n log n)). ``ordered`` holds at least 2 values.

    >>> peers_median(np.array([1.0, 2, 3, 10]), np.array([3, 0])).tolist()
    [2.0, 3.0]
    >>> peers_median(np.array([1.0, 5, 9]), np.array([1])).tolist()
    [5.0]
    """
    m = len(ordered) - 1

    def at(k: int) -> Array:  # element k of the list without the one at ``rank``
        return np.where(k < rank, ordered[k], ordered[k + 1])

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    v = latency_of(rnd, p.signal)
    rate = rnd.stat("request_rate")
    if p.normalize_by_capacity:
        v = v * rnd.columns.capacity
    judged = ~np.isnan(v) & ~(rate < p.min_request_rate) & (v > 0) & np.isfinite(v)  # NaN rate: unknown, judged
    outliers: dict[str, tuple[float, str]] = {}
    specs = rnd.specs
    if any(s.tier != "edge" for s in specs):  # tiers: each judged among its own tier's endpoints
        tiers = np.array([s.tier for s in specs])
        for tier in np.unique(tiers).tolist():
            _judge(rnd, p, v, judged & (tiers == tier), outliers, f" among the {tier} tier")
    else:
        _judge(rnd, p, v, judged, outliers, "")
    return eject(rnd, p, state, outliers, "latency outlier")


def _judge(rnd: ClusterRound, p: Params, v: Array, judged: Array, outliers: dict[str, tuple[float, str]],
           among: str) -> None:
    """Add to ``outliers`` the ``judged`` members far above their judged peers' median."""
    values = v[judged]
    if len(values) < p.min_hosts:
        return
    ordered = np.sort(values)
    ref = peers_median(ordered, np.searchsorted(ordered, values, side="left"))
    out = (ref > 0) & (values > p.factor * ref) & (values - ref >= p.min_delta_ms)
    unit = " (capacity-normalised)" if p.normalize_by_capacity else ""
    where = np.flatnonzero(judged)[out].tolist()
    for i, lat, peers in zip(where, values[out].tolist(), ref[out].tolist(), strict=True):
        outliers[rnd.addresses[i]] = (lat / peers, f"{p.signal} latency {lat:.0f} ms > {p.factor:g} x peers' "
                                                   f"median {peers:.0f} ms{unit}{among}")


PLUGIN = Filter("latency_outlier", Params, _run)
