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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from tests.support.reference_engine.plugin import ClusterRound, Factor, PluginParams, State


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


def _run(rnd: ClusterRound, p: Params, state: State, weights: Mapping[str, float]
         ) -> tuple[Mapping[str, float], State]:
    configured = {m.address: m.spec.capacity for m in rnd.members}
    if p.mode == "configured":
        return configured, state
    new: dict[str, Warmup] = dict(state)
    for m in rnd.members:
        lat = m.stats.latency_mean_ms
        w = new.get(m.address)
        if w is not None and w.done:
            continue
        if w is None:
            if lat is not None and lat > 0:
                new[m.address] = Warmup(rnd.now, lat, 1)
            continue
        if rnd.now - w.started >= p.warmup_s:
            new[m.address] = Warmup(w.started, w.total_ms, w.samples, done=True)
        elif lat is not None and lat > 0:
            new[m.address] = Warmup(w.started, w.total_ms + lat, w.samples + 1)
    by_class: dict[str, list[float]] = {}
    class_cap: dict[str, float] = {}
    for m in rnd.members:
        class_cap[m.spec.gpu_class] = m.spec.capacity
        w = new.get(m.address)
        if w is not None and w.done and w.samples:
            by_class.setdefault(m.spec.gpu_class, []).append(w.total_ms / w.samples)
    if not by_class:
        return configured, new
    lat = {c: statistics.median(v) for c, v in by_class.items()}
    fastest = min(lat, key=lambda c: (lat[c], c))
    out = {m.address: (class_cap[fastest] * lat[fastest] / lat[m.spec.gpu_class]
                       if m.spec.gpu_class in lat else m.spec.capacity) for m in rnd.members}
    return out, new


PLUGIN = Factor("capacity", Params, _run)
