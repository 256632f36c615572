"""Pure simulation model of one GPU inference node: no I/O, no asyncio, no clocks.

Covers the GPU classes, the latency model, GPU memory accounting, the session (KV cache) LRU
and GPU utilisation. Everything here is deterministic given its inputs.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

#: Memory held by the weights of a 7B model in fp16, MiB.
DEFAULT_WEIGHTS_MIB = 14336.0

#: Field figures for a 7B model on one A100: (requests in flight, end-to-end latency ms).
LATENCY_TABLE_MS: tuple[tuple[int, float], ...] = ((1, 50.0), (2, 95.0), (4, 220.0))

#: Multiplier of a long-tail request's latency.
LONG_TAIL_FACTOR = 10.0

#: Share of the (non-penalty) service time spent before the first token.
PREFILL_SHARE = 0.3


@dataclass(frozen=True)
class GpuClass:
    """One GPU model: ``latency_factor`` multiplies A100 latency; ``memory_mib`` is total memory."""

    key: str
    dcgm_model_name: str
    latency_factor: float
    memory_mib: int


GPU_CLASSES: dict[str, GpuClass] = {
    "a100": GpuClass("a100", "NVIDIA A100-SXM4-80GB", 1.0, 81920),
    "a10": GpuClass("a10", "NVIDIA A10", 2.5, 24576),
    "h100": GpuClass("h100", "NVIDIA H100 80GB HBM3", 0.6, 81920),
}


def base_latency_ms(in_flight: int) -> float:
    """A100 latency in ms of one request when ``in_flight`` requests run (itself included).

    Piecewise-linear through :data:`LATENCY_TABLE_MS`; beyond the last point it extrapolates
    with the slope of the last segment (62.5 ms per extra request). ``in_flight < 1`` counts as 1.
    """
    n = max(1, in_flight)
    points = LATENCY_TABLE_MS
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (n - x1)


@dataclass(frozen=True)
class LatencyPlan:
    """Decided timing of one request once it starts running.

    ``service_ms``: running time (queue wait excluded). ``prefill_ms``: the part of it before
    the first token. ``session_hit`` / ``long_tail``: which modifiers applied.
    """

    service_ms: float
    prefill_ms: float
    session_hit: bool
    long_tail: bool


def plan_latency(
    in_flight: int,
    gpu: GpuClass,
    *,
    session_hit: bool,
    long_tail: bool = False,
    time_scale: float = 1.0,
    slow_factor: float = 1.0,
    prefill_penalty_ms: float = 40.0,
) -> LatencyPlan:
    """Latency of a request that starts with ``in_flight`` requests running (itself included).

    service = (base(in_flight) + penalty if new session) x class factor x time_scale
    x slow_factor (x 10 if long tail). The prefill part is 30 % of the base part plus the penalty.
    """
    scale = gpu.latency_factor * time_scale * slow_factor * (LONG_TAIL_FACTOR if long_tail else 1.0)
    base = base_latency_ms(in_flight)
    penalty = 0.0 if session_hit else prefill_penalty_ms
    return LatencyPlan(
        service_ms=(base + penalty) * scale,
        prefill_ms=(base * PREFILL_SHARE + penalty) * scale,
        session_hit=session_hit,
        long_tail=long_tail,
    )


def draw_long_tail(rng: random.Random, probability: float) -> bool:
    """True with ``probability`` (0-1); draws exactly one number from ``rng`` so runs stay seeded."""
    return rng.random() < probability


class MemoryPool:
    """GPU memory accounting in MiB: fixed weights plus memory held by admitted requests."""

    def __init__(self, total_mib: float, weights_mib: float) -> None:
        if total_mib <= weights_mib:
            raise ValueError("total memory must exceed the weights")
        self.total_mib = float(total_mib)
        self.weights_mib = float(weights_mib)
        self.held_mib = 0.0

    @property
    def kv_capacity_mib(self) -> float:
        """Memory available to requests (total - weights), MiB."""
        return self.total_mib - self.weights_mib

    @property
    def used_mib(self) -> float:
        """Weights plus held memory, MiB."""
        return self.weights_mib + self.held_mib

    @property
    def free_mib(self) -> float:
        """Total minus used, MiB."""
        return self.total_mib - self.used_mib

    @property
    def kv_usage(self) -> float:
        """Held memory / (total - weights), 0-1."""
        return min(1.0, self.held_mib / self.kv_capacity_mib)

    def try_reserve(self, mib: float) -> bool:
        """Reserve ``mib`` MiB if it fits (used + mib <= total); False (and no change) if not."""
        if mib < 0:
            raise ValueError("cannot reserve negative memory")
        if self.used_mib + mib > self.total_mib:
            return False
        self.held_mib += mib
        return True

    def release(self, mib: float) -> None:
        """Give back ``mib`` MiB reserved earlier."""
        self.held_mib = max(0.0, self.held_mib - mib)
        if self.held_mib < 1e-9:
            self.held_mib = 0.0


class SessionCache:
    """LRU of session keys whose KV cache is warm on this node (at most ``capacity`` keys)."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def touch(self, key: str) -> bool:
        """Mark ``key`` as most recently used; True if it was already cached (a hit)."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return False


def request_memory_mib(max_tokens: int, kv_mib_per_token: float, explicit_mib: float | None = None) -> float:
    """Memory a request holds while admitted, MiB: ``explicit_mib`` if given, else tokens x MiB/token."""
    if explicit_mib is not None:
        return float(explicit_mib)
    return max_tokens * kv_mib_per_token


def gpu_util_percent(running: int, max_concurrency: int) -> float:
    """DCGM-style GPU utilisation, percent 0-100: proportional to running / max_concurrency."""
    if running <= 0:
        return 0.0
    return min(100.0, 100.0 * running / max_concurrency)


def estimate_tokens(text: str) -> int:
    """Rough token count of ``text`` (4 characters per token, at least 1)."""
    return max(1, (len(text) + 3) // 4)
