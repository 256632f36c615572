"""``capacity``: the per-GPU-class capacity factor for heterogeneous pools.

``mode: configured`` (default): the class's ``capacity`` from ``gpu_classes`` (throughput relative to
an A100). ``mode: measured``: measured at warm-up — each endpoint's mean latency is averaged over
its first ``warmup_s`` seconds with latency data; per class the median of those is the class's
latency; the fastest measured class keeps its configured capacity and every other measured class
gets ``capacity(fastest) x latency(fastest) / latency(class)``. Classes not measured yet use their
configured capacity. Best measured under light, even warm-up load (latency grows with load).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from xds_server.engine.plugin import Array, ClusterRound, Factor, PluginParams, State


class Params(PluginParams):
    """``mode``: configured | measured; ``warmup_s``: how long an endpoint's latency is averaged (s)."""

    mode: Literal["configured", "measured"] = "configured"
    warmup_s: float = Field(60.0, gt=0)


@dataclass(frozen=True, slots=True)
class Warmup:
    """An endpoint's warm-up: since when (s), latency sum (ms) and samples; ``done`` once measured."""

    started: float
    total_ms: float
    samples: int
    done: bool = False


def _run(rnd: ClusterRound, p: Params, state: State, weights: Array) -> tuple[Array, State]:
    configured = rnd.columns.capacity
    if p.mode == "configured":
        return configured, state
    new: dict[str, Warmup] = dict(state)
    latencies = rnd.stat("latency_mean_ms").tolist()
    for address, lat in zip(rnd.addresses, latencies, strict=True):
        w = new.get(address)
        if w is not None and w.done:
            continue
        if w is None:
            if lat > 0:  # NaN (no data) is not
                new[address] = Warmup(rnd.now, lat, 1)
            continue
        if rnd.now - w.started >= p.warmup_s:
            new[address] = Warmup(w.started, w.total_ms, w.samples, done=True)
        elif lat > 0:
            new[address] = Warmup(w.started, w.total_ms + lat, w.samples + 1)
    by_class: dict[str, list[float]] = {}
    class_cap: dict[str, float] = {}
    for address, s in zip(rnd.addresses, rnd.specs, strict=True):
        class_cap[s.gpu_class] = s.capacity
        w = new.get(address)
        if w is not None and w.done and w.samples:
            by_class.setdefault(s.gpu_class, []).append(w.total_ms / w.samples)
    if not by_class:
        return configured, new
    lat = {c: statistics.median(v) for c, v in by_class.items()}
    fastest = min(lat, key=lambda c: (lat[c], c))
    return np.array([class_cap[fastest] * lat[fastest] / lat[s.gpu_class] if s.gpu_class in lat else s.capacity
                     for s in rnd.specs], dtype=float), new


PLUGIN = Factor("capacity", Params, _run)
