"""One simulated inference node: admission, FIFO queue, latency, sessions, faults, metrics.

Glues the pure :mod:`sim.model` to asyncio time. HTTP lives in :mod:`sim.server`.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass
from typing import Any

from sim.config import BackendConfig
from sim.faults import FaultState
from sim.gate import ConcurrencyGate
from sim.metrics import GaugeSnapshot, SimMetrics
from sim.model import (
    GPU_CLASSES,
    LatencyPlan,
    MemoryPool,
    SessionCache,
    draw_long_tail,
    gpu_util_percent,
    plan_latency,
    request_memory_mib,
)
from sim.protocol import InferenceRequest


class OutOfMemory(Exception):
    """Admitting the request would exceed GPU memory (sizes in MiB)."""

    def __init__(self, requested_mib: float, free_mib: float, total_mib: float) -> None:
        self.requested_mib = requested_mib
        self.free_mib = free_mib
        self.total_mib = total_mib
        super().__init__(
            f"CUDA out of memory. Tried to allocate {requested_mib:.0f} MiB "
            f"(GPU 0; {total_mib:.0f} MiB total capacity; {free_mib:.0f} MiB free)"
        )


class NodeClosing(Exception):
    """The node is shutting down; the request was not served."""


@dataclass(frozen=True)
class Completion:
    """Outcome of a served request; times in seconds, memory in MiB."""

    request_id: str
    text: str
    plan: LatencyPlan
    queue_s: float
    e2e_s: float
    memory_mib: float


def gpu_uuid_for(hostname: str, served_by: str, seed: int | None) -> str:
    """Deterministic DCGM-style GPU UUID (``GPU-xxxxxxxx-...``) for one backend address."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"inferlb-sim://{hostname}/{served_by}/{seed}"))


class SimNode:
    """State and behaviour of one simulated backend. Use from a single event loop."""

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.gpu = GPU_CLASSES[cfg.gpu_class]
        self.memory = MemoryPool(cfg.gpu_memory_total_mib, cfg.weights_mib)
        self.sessions = SessionCache(cfg.session_cache_size)
        self.gate = ConcurrencyGate(cfg.max_concurrency)
        self.faults = FaultState(cfg.long_tail)
        self.rng = random.Random(cfg.seed)
        self.served_by = f"{cfg.host}:{cfg.port}"
        self.metrics = SimMetrics(
            model_name=cfg.model_name,
            gpu_model_name=self.gpu.dcgm_model_name,
            gpu_uuid=gpu_uuid_for(cfg.hostname, self.served_by, cfg.seed),
            hostname=cfg.hostname,
            legacy_kv_name=cfg.legacy_metrics,
        )
        self.counters = {
            "requests": 0,
            "success": 0,
            "oom": 0,
            "bad_requests": 0,
            "cancelled": 0,
            "session_hits": 0,
            "session_misses": 0,
            "long_tail": 0,
        }
        self.hung = 0  # requests currently held by the hang fault
        self._seq = 0

    def bind(self, served_by: str) -> None:
        """Record the address actually listened on (``HOST:PORT``), e.g. after binding port 0."""
        self.served_by = served_by
        self.metrics.set_gpu_uuid(gpu_uuid_for(self.cfg.hostname, served_by, self.cfg.seed))

    async def serve(self, req: InferenceRequest) -> Completion:
        """Serve one request: hang fault, memory admission, FIFO slot, simulated latency.

        Raises :class:`OutOfMemory` at once if the memory does not fit, :class:`NodeClosing` on
        shutdown. Memory and the running slot are released however the request ends.
        """
        self.counters["requests"] += 1
        self.hung += 1
        try:
            await self.faults.wait_while(lambda: self.faults.hang)
        finally:
            self.hung -= 1
        if self.faults.closing:
            raise NodeClosing("backend is shutting down")
        mib = request_memory_mib(req.max_tokens, self.cfg.kv_mib_per_token, req.memory_mib)
        if not self.memory.try_reserve(mib):
            self.counters["oom"] += 1
            self.metrics.observe_oom()
            raise OutOfMemory(mib, self.memory.free_mib, self.memory.total_mib)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await self.gate.acquire()
            try:
                queue_s = loop.time() - arrived
                plan = self._plan(req)
                await asyncio.sleep(plan.service_ms / 1000.0)
            finally:
                self.gate.release()
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            raise
        finally:
            self.memory.release(mib)
        return self._finish(req, plan, queue_s, mib)

    def _plan(self, req: InferenceRequest) -> LatencyPlan:
        """Decide latency at start of running (session lookup, long-tail draw)."""
        hit = False
        if req.session_key is not None:
            hit = self.sessions.touch(req.session_key)
            self.counters["session_hits" if hit else "session_misses"] += 1
            self.metrics.observe_session(hit)
        long_tail = draw_long_tail(self.rng, self.faults.long_tail)
        if long_tail:
            self.counters["long_tail"] += 1
        return plan_latency(
            self.gate.running,
            self.gpu,
            session_hit=hit,
            long_tail=long_tail,
            time_scale=self.cfg.time_scale,
            slow_factor=self.faults.slow_factor,
            prefill_penalty_ms=self.cfg.prefill_penalty_ms,
        )

    def _finish(self, req: InferenceRequest, plan: LatencyPlan, queue_s: float, mib: float) -> Completion:
        self._seq += 1
        self.counters["success"] += 1
        e2e_s = queue_s + plan.service_ms / 1000.0
        self.metrics.observe_finished(
            e2e_s=e2e_s,
            ttft_s=queue_s + plan.prefill_ms / 1000.0,
            queue_s=queue_s,
            prompt_tokens=req.prompt_tokens,
            generation_tokens=req.max_tokens,
        )
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        return Completion(
            request_id=f"{prefix}-{self.metrics.gpu_uuid[4:12]}-{self._seq}",
            text=f"Simulated reply from {self.cfg.model_name} {self.cfg.version} on {self.served_by}.",
            plan=plan,
            queue_s=queue_s,
            e2e_s=e2e_s,
            memory_mib=mib,
        )

    def gauges(self) -> GaugeSnapshot:
        """Current gauge values for the exposition."""
        return GaugeSnapshot(
            running=self.gate.running,
            waiting=self.gate.waiting,
            kv_usage=self.memory.kv_usage,
            gpu_util_percent=gpu_util_percent(self.gate.running, self.cfg.max_concurrency),
            fb_used_mib=self.memory.used_mib,
            fb_free_mib=self.memory.free_mib,
        )

    def state(self) -> dict[str, Any]:
        """JSON-able view of the node for ``GET /sim/state`` (memory in MiB, kv_usage 0-1)."""
        return {
            "served_by": self.served_by,
            "version": self.cfg.version,
            "model_name": self.cfg.model_name,
            "gpu_class": self.gpu.key,
            "gpu_model_name": self.gpu.dcgm_model_name,
            "time_scale": self.cfg.time_scale,
            "max_concurrency": self.cfg.max_concurrency,
            "running": self.gate.running,
            "waiting": self.gate.waiting,
            "hung": self.hung,
            "gpu_util_percent": gpu_util_percent(self.gate.running, self.cfg.max_concurrency),
            "memory": {
                "total_mib": self.memory.total_mib,
                "weights_mib": self.memory.weights_mib,
                "held_mib": self.memory.held_mib,
                "used_mib": self.memory.used_mib,
                "free_mib": self.memory.free_mib,
                "kv_usage": self.memory.kv_usage,
            },
            "sessions_cached": len(self.sessions),
            "faults": self.faults.as_dict(),
            "counters": dict(self.counters),
        }
