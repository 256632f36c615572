"""Runtime fault controls of a simulated backend (driven by ``POST /sim/fault``).

Patch format (JSON object, every key optional, unknown keys rejected)::

    {"hang": true|false}                  # inference requests are accepted but held unanswered
    {"metrics": "ok"|"error"|"hang"}      # /metrics answers normally, 503, or never
    {"slow_factor": F}                    # F > 0 multiplies the latency of new requests
    {"push": "ok"|"stop"}                 # node-status pushes go on, or pause (stream stays open)
    {"etcd": "ok"|"stop"}                 # etcd keep-alives and status writes go on, or pause (the lease expires)
    {"long_tail": P}                      # probability 0-1 of a 10x-latency request
    {"reset": true}                       # back to no faults (long_tail = the configured value)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

METRICS_MODES = ("ok", "error", "hang")
PUSH_MODES = ("ok", "stop")


class FaultError(ValueError):
    """A bad fault patch; ``field`` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _number(body: dict[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(key, f"'{key}' must be a number")
    return float(value)


def parse_fault_patch(body: Any) -> dict[str, Any]:
    """Validate a fault patch; returns the normalised patch or raises :class:`FaultError`."""
    if not isinstance(body, dict):
        raise FaultError("body", "fault patch must be a JSON object")
    known = {"hang", "metrics", "slow_factor", "long_tail", "push", "etcd", "reset"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise FaultError(unknown[0], f"unknown fault field '{unknown[0]}' (known: {sorted(known)})")
    patch: dict[str, Any] = {}
    for key in ("hang", "reset"):
        if key in body:
            if not isinstance(body[key], bool):
                raise FaultError(key, f"'{key}' must be true or false")
            patch[key] = body[key]
    if "metrics" in body:
        if body["metrics"] not in METRICS_MODES:
            raise FaultError("metrics", f"'metrics' must be one of {list(METRICS_MODES)}")
        patch["metrics"] = body["metrics"]
    for key in ("push", "etcd"):
        if key in body:
            if body[key] not in PUSH_MODES:
                raise FaultError(key, f"'{key}' must be one of {list(PUSH_MODES)}")
            patch[key] = body[key]
    if "slow_factor" in body:
        patch["slow_factor"] = _number(body, "slow_factor")
        if patch["slow_factor"] <= 0:
            raise FaultError("slow_factor", "'slow_factor' must be > 0")
    if "long_tail" in body:
        patch["long_tail"] = _number(body, "long_tail")
        if not 0.0 <= patch["long_tail"] <= 1.0:
            raise FaultError("long_tail", "'long_tail' must be a probability in 0-1")
    return patch


class FaultState:
    """Current faults, plus events that held requests wait on until a fault clears."""

    def __init__(self, long_tail: float = 0.0) -> None:
        self.default_long_tail = long_tail
        self.hang = False
        self.metrics = "ok"
        self.push = "ok"
        self.etcd = "ok"
        self.slow_factor = 1.0
        self.long_tail = long_tail
        self.closing = False
        self._changed = asyncio.Event()

    def apply(self, patch: dict[str, Any]) -> None:
        """Apply a patch from :func:`parse_fault_patch` (``reset`` first, then the other keys)."""
        if patch.get("reset"):
            self.hang, self.metrics, self.push, self.etcd, self.slow_factor = False, "ok", "ok", "ok", 1.0
            self.long_tail = self.default_long_tail
        for key in ("hang", "metrics", "push", "etcd", "slow_factor", "long_tail"):
            if key in patch:
                setattr(self, key, patch[key])
        self._wake()

    def close(self) -> None:
        """Shutting down: release every held request so the server can stop quickly."""
        self.closing = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_while(self, predicate: Callable[[], bool]) -> None:
        """Block while ``predicate()`` is true and the backend is not closing."""
        while predicate() and not self.closing:
            await self._changed.wait()

    def as_dict(self) -> dict[str, Any]:
        """JSON-able view: hang, metrics, push, etcd, slow_factor, long_tail."""
        return {
            "hang": self.hang,
            "metrics": self.metrics,
            "push": self.push,
            "etcd": self.etcd,
            "slow_factor": self.slow_factor,
            "long_tail": self.long_tail,
        }
