"""``latency_outlier``: ejects an endpoint whose time per output token is far above what its peers
take at its load.

Load raises latency on any GPU, so raw end-to-end latency compares a busy endpoint with an idle one
(a fault-free ``inferlb demo`` ejected its two most loaded A100s that way, issue 39). The judged
signal is per unit of work: the inter-token latency (``itl_mean_ms``: one decode step at the batch
the request ran in; vLLM V1's ``vllm:inter_token_latency_seconds``, SGLang's and TGI's equivalents),
multiplied by the endpoint's GPU-class capacity (``normalize_by_capacity``: an A10 that is as slow as
an A10 should be is no outlier next to A100s), and compared with its peers' at the endpoint's own
batch ``b`` (``running``, the window's average of running requests, at least 1).

A decode step takes longer the larger the batch, by how much depends on the engine: nearly flat
while decode is memory-bound (vLLM's continuous batching, fitted by llm-d's BLIS simulator,
inference-sim/inference-sim ``defaults.yaml``: step = β0 + β2·b, an A100 step 16.5 ms at 1 running,
17.6 ms at 64), up to 3.5x at ``max_num_seqs`` in llm-d's inference simulator
(llm-d/llm-d-inference-sim ``docs/latency-simulation.md``), proportional to the batch when the GPU
is saturated (the simulator's ``job`` engine: 3.2 ms at 1 running, 31 ms at 8). So the filter learns
the pool's curve, ITL ∝ b^α, from how each endpoint's own ITL moved with its own batch over time (a
within-endpoint regression of log ITL on log b, each endpoint's sums decaying with a half-life of
``fit_half_life_s``; a constantly slow endpoint only raises its own intercept, so it does not bend
the curve): the reference of an endpoint at batch ``b`` is ``b^α`` x the median over its peers of
``ITL_j / b_j^α``. Until the batches have moved enough to tell α (a within-endpoint spread of
``log b`` below ``min_batch_spread``), one bound serves, right for both extremes: batching never
lowers throughput, so a step at batch ``b`` takes at most ``b / b_j`` times a step at a smaller
batch ``b_j``, and the reference is the larger of the peers' median ITL (α = 0) and ``b`` x their
median ITL per running request (α = 1). A healthy endpoint is then about 1x its reference whatever
the engine and its load, a slow one (every token ``k`` times slower: the simulator's
``slow_factor`` or ``long_tail``, a throttled GPU) about ``k`` x. It is an outlier above ``factor`` x
its reference and at least ``min_delta_ms`` above it. The bound is conservative: a slow endpoint on
a flat engine that runs a much larger batch than its peers hides behind it until α is learned.

Endpoints without an ITL (Triton's preset has none) or a request rate below ``min_request_rate``
(req/s) are not judged. A pool with fewer than ``min_hosts`` judged endpoints is not judged at all:
next to one or two peers, "far above the peers' median" is "busier than the other one"; Envoy's
success-rate outlier detection has the same floor (``success_rate_minimum_hosts``, default 5, in
https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/outlier_detection.proto).
Ejection times, their growth with repeats and ``max_ejection_percent`` follow :mod:`..ejection`
(Envoy's outlier-detection rules).

In a cluster with edge and cloud tiers an endpoint's peers are the endpoints of its own tier (and
``min_hosts`` counts per tier): the picker keeps the edge near its spill threshold and the cloud
mostly idle by design (seen in the ``edge_cloud`` benchmark: a loaded edge A10 ejected next to idle
A100s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from xds_server.engine.ejection import Ejection, EjectionParams, eject
from xds_server.engine.plugin import Array, ClusterRound, Filter, State


class Params(EjectionParams):
    """See the module docstring."""

    factor: float = Field(3.0, gt=1)
    min_delta_ms: float = Field(1.0, ge=0)
    min_request_rate: float = Field(0.0, ge=0)
    min_hosts: int = Field(3, ge=2)
    normalize_by_capacity: bool = True
    fit_half_life_s: float = Field(300.0, gt=0)
    min_batch_spread: float = Field(0.15, gt=0)


@dataclass(frozen=True, slots=True)
class Record:
    """One endpoint's state: its ejection record (None: none) and its decayed sums of
    ``x = log b``, ``y = log ITL`` over the rounds it was judged and no outlier (``at``: the last, s)."""

    ejection: Ejection | None = None
    at: float = 0.0
    sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # w, Σx, Σy, Σxx, Σxy


def curve(records: Mapping[str, Record], addresses: list[str], min_spread: float) -> float | None:
    """The exponent α of ITL ∝ b^α (clamped to 0-1) from the within-endpoint sums of ``addresses``,
    or None while their batches have moved too little to tell (within-endpoint standard deviation of
    ``log b`` below ``min_spread``)."""
    sxx = sxy = w = 0.0
    for a in addresses:
        r = records.get(a)
        if r is None or r.sums[0] <= 1.0:
            continue
        n, x, y, xx, xy = r.sums
        sxx += xx - x * x / n
        sxy += xy - x * y / n
        w += n
    if w <= 0.0 or sxx / w < min_spread * min_spread:
        return None
    return min(1.0, max(0.0, sxy / sxx))


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


def _peers(values: Array) -> Array:
    """Each value's peers' median (the others of ``values``, at least 2 of them)."""
    ordered = np.sort(values)
    return peers_median(ordered, np.searchsorted(ordered, values, side="left"))


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    itl = rnd.stat("itl_mean_ms")
    if p.normalize_by_capacity:
        itl = itl * rnd.columns.capacity
    batch = np.maximum(1.0, np.nan_to_num(rnd.stat("running"), nan=1.0))
    rate = rnd.stat("request_rate")
    judged = (itl > 0) & np.isfinite(itl) & ~(rate < p.min_request_rate)  # NaN rate: unknown, judged
    outliers: dict[str, tuple[float, str]] = {}
    specs = rnd.specs
    if any(s.tier != "edge" for s in specs):  # tiers: each judged among its own tier's endpoints
        tiers = np.array([s.tier for s in specs])
        for tier in np.unique(tiers).tolist():
            _judge(rnd, p, state, itl, batch, judged & (tiers == tier), outliers, f" among the {tier} tier")
    else:
        _judge(rnd, p, state, itl, batch, judged, outliers, "")
    ejections = {a: r.ejection for a, r in state.items() if r.ejection is not None}
    reasons, ejected = eject(rnd, p, ejections, outliers, "latency outlier")
    new = {a: Record(None, r.at, r.sums) for a, r in state.items() if r.sums[0] > 0.0}
    for a, e in ejected.items():
        r = new.get(a, Record())
        new[a] = Record(e, r.at, r.sums)
    decay = math.log(2.0) / p.fit_half_life_s
    addresses = rnd.addresses
    for i in np.flatnonzero(judged).tolist():
        a = addresses[i]
        if a in outliers or a in reasons:
            continue
        r = new.get(a, Record())
        keep = math.exp(-decay * max(0.0, rnd.now - r.at)) if r.sums[0] > 0.0 else 0.0
        x, y = math.log(float(batch[i])), math.log(float(itl[i]))
        n, sx, sy, sxx, sxy = (v * keep for v in r.sums)
        new[a] = Record(r.ejection, rnd.now, (n + 1.0, sx + x, sy + y, sxx + x * x, sxy + x * y))
    return reasons, new


def _judge(rnd: ClusterRound, p: Params, state: State, itl: Array, batch: Array, judged: Array,
           outliers: dict[str, tuple[float, str]], among: str) -> None:
    """Add to ``outliers`` the ``judged`` members far above the reference their judged peers give."""
    values, b = itl[judged], batch[judged]
    if len(values) < p.min_hosts:
        return
    where = np.flatnonzero(judged)
    alpha = curve(state, [rnd.addresses[i] for i in where.tolist()], p.min_batch_spread)
    if alpha is None:  # the bound: the larger of a flat and a proportional curve
        ref = np.maximum(_peers(values), b * _peers(values / b))
        how = ""
    else:
        ref = b ** alpha * _peers(values / b ** alpha)
        how = f"; ITL ~ running^{alpha:.2f}"
    out = (values > p.factor * ref) & (values - ref >= p.min_delta_ms)
    unit = " (capacity-normalised)" if p.normalize_by_capacity else ""
    for i, lat, peers, n in zip(where[out].tolist(), values[out].tolist(), ref[out].tolist(), b[out].tolist(),
                                strict=True):
        outliers[rnd.addresses[i]] = (lat / peers, f"inter-token latency {lat:.3g} ms > {p.factor:g} x the "
                                                   f"{peers:.3g} ms its peers take at its load ({n:.1f} running"
                                                   f"{how}){unit}{among}")


PLUGIN = Filter("latency_outlier", Params, _run)
