"""A sample of recent picker decisions for operators (``GET /api/v1/decisions``), nearly free per request.

Every request pays one ``next()`` on an :func:`itertools.count` and a modulo; every ``every``-th
decision's session key, version header and decision are appended to a bounded
:class:`collections.deque` (appends and copies are atomic in CPython: no lock, nothing shared with
the slow loop that could block a request). The work of describing a sample happens when it is read.
Session keys are never shown in clear: a sample shows a keyed BLAKE2b digest of it, with a key drawn
at random per process, so it can be compared within one run and not reversed or correlated across
runs.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ext_proc.picker import Decision
from ext_proc.view import RoutingTable

__all__ = ["DecisionSampler", "SampledDecision"]


@dataclass(frozen=True, slots=True)
class SampledDecision:
    """One sampled decision.

    Attributes:
        at: when it was made (Unix s).
        session: 16 hex digits of the keyed hash of the session key, None without one.
        version: the model-version header as sent (None: absent, the default version applied).
        cluster: the chosen cluster (None when rejected or not ready).
        endpoint: the pinned ``HOST:PORT`` (None: Envoy's weighted fallback chooses).
        reason: the decision's reason label (see :class:`ext_proc.picker.Decision`).
        status: HTTP status of a rejection, None when routed.
        key: the affinity key the request had: "session", "prefix" or "none".
        work: its predicted work (1 = a typical request).
        memory_mib: its GPU memory need (MiB, before the margin).
        plugins: the scheduling plugins that decided it (:attr:`ext_proc.picker.Decision.plugins`).
    """

    at: float
    session: str | None
    version: str | None
    cluster: str | None
    endpoint: str | None
    reason: str
    status: int | None
    key: str = "none"
    work: float = 1.0
    memory_mib: float = 0.0
    plugins: str = ""

    def as_dict(self) -> dict:
        """JSON-ready form (keys as the attributes)."""
        return {"at": self.at, "session": self.session, "version": self.version, "cluster": self.cluster,
                "endpoint": self.endpoint, "reason": self.reason, "status": self.status, "key": self.key,
                "work": self.work, "memory_mib": self.memory_mib, "plugins": self.plugins}


class DecisionSampler:
    """Keeps every ``every``-th decision, the newest ``size`` of them.

    Args:
        every: sampling period in decisions (>= 1; 1 keeps all).
        size: samples kept (>= 1).
        clock: Unix time source (s), read only for sampled decisions.
    Raises:
        ValueError: ``every`` or ``size`` < 1.
    """

    def __init__(self, every: int = 64, size: int = 256, clock: Callable[[], float] = time.time) -> None:
        if every < 1 or size < 1:
            raise ValueError(f"every and size must be >= 1, got every={every}, size={size}")
        self.every = every
        self.size = size
        self._ticks = itertools.count()
        self._samples: deque[tuple[float, bytes | None, bytes | None, Decision]] = deque(maxlen=size)
        self._clock = clock
        self._key = os.urandom(16)

    def offer(self, headers: Mapping[str, bytes], routing: RoutingTable, decision: Decision) -> None:
        """Count one decision; keep it when it is the ``every``-th. Never raises.

        A kept sample holds only the session key, the version header and the decision; hashing and
        decoding wait for :meth:`recent`, off the request path.
        """
        if next(self._ticks) % self.every:
            return
        key = None
        for name in routing.session_headers:
            key = headers.get(name)
            if key:
                break
        self._samples.append((self._clock(), key, headers.get(routing.version_header), decision))

    def _describe(self, at: float, key: bytes | None, version: bytes | None, decision: Decision) -> SampledDecision:
        session = hashlib.blake2b(key, digest_size=8, key=self._key).hexdigest() if key else None
        shown = version[:256].decode("utf-8", errors="backslashreplace") if version else None
        return SampledDecision(at, session, shown, decision.cluster, decision.endpoint, decision.reason,
                               decision.status, decision.key, decision.work, decision.mib, decision.plugins)

    def recent(self, limit: int | None = None) -> list[SampledDecision]:
        """The kept samples, newest first (at most ``limit``)."""
        kept = list(self._samples)
        kept.reverse()
        return [self._describe(*sample) for sample in (kept if limit is None else kept[:limit])]
