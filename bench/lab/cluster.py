"""A lab cluster: its nodes (engines), how they are grouped into model versions, and the inferlb config
that describes it (pure data).

The config is what a user of ``inferlb serve`` would write for these nodes: one service, one
version per cluster, each node an endpoint with its GPU class, memory, tier and max concurrency,
how its engines hold GPU memory (a version of job engines: per request), and the lab's slow-loop
timing (:class:`SlowLoopTiming`); the metrics presets are inferlb's defaults (vLLM, DCGM).
It is parsed by inferlb's own loader (:func:`xds_server.config.parse_config`), so every default the
slow loop and the picker run with in the lab is the one ``inferlb serve`` would use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from bench.quality.policies import PICKER, SESSION_AFFINITY
from inferlb.picker_config import CONFIG_CHECKS
from xds_server.config import Config, cluster_name, parse_config

__all__ = ["SERVICE", "Cluster", "Node", "SlowLoopTiming"]

#: The service every lab request is for (its clusters are ``chat-<version>``).
SERVICE = "chat"
#: The lab's Envoy route timeout (s): longer than any run, so no request is timed out.
NO_ROUTE_TIMEOUT_S = 86400.0
#: The ``model`` name clients send (any name of the service's models means its default version).
MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class Node:
    """One simulated engine.

    Attributes:
        kind: ``llm`` (continuous batching) or ``job`` (the seed's per-request GPU server).
        gpu_class: the engine's GPU class (``a100``, ``h100``, ``a10``, ...).
        version: the model version it serves (its cluster: ``chat-<version>``).
        gpu_memory_mib: its GPU memory (None: the class's).
        tier: ``edge`` or ``cloud``.
        present: False for a node that joins during the run (an ``add`` event).
        max_concurrency: the config's ``max_concurrency`` for it (None: inferlb's default).
        engine: extra keyword arguments of the engine (``max_num_seqs``, ...).
    """

    kind: Literal["llm", "job"] = "llm"
    gpu_class: str = "a100"
    version: str = "v1"
    gpu_memory_mib: float | None = None
    tier: Literal["edge", "cloud"] = "edge"
    present: bool = True
    max_concurrency: int | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SlowLoopTiming:
    """The information delays of the slow loop (s), as parameters.

    Attributes:
        scrape_interval_s: how often Prometheus scrapes each engine (the lab's choice: 5 s; the
            field's ServiceMonitors commonly use 5-30 s).
        window_s: inferlb's ``prometheus.window_s`` (default 60).
        interval_s: inferlb's ``loop.interval_s``, a weight round (default 5).
        stale_after_s: inferlb's ``engine.stale_after_s`` (default 15).
        access_log_flush_s: Envoy's completion-log flush, inferlb's ``picker.access_log_flush_s``
            (default 0.005): how late inferlb's picker learns that a request ended.
    """

    scrape_interval_s: float = 5.0
    window_s: float = 60.0
    interval_s: float = 5.0
    stale_after_s: float = 15.0
    access_log_flush_s: float = 0.005


@dataclass(frozen=True)
class Cluster:
    """The lab's nodes; node ``i`` listens at :meth:`address` ``(i)``.

    Attributes:
        nodes: the engines.
        engine: inferlb ``engine`` settings for this cluster (on top of the defaults).
        picker: inferlb ``picker`` settings for this cluster (on top of the benchmarks' own,
            :data:`bench.quality.policies.PICKER`: body routing, admission, the memory queue).
    """

    nodes: tuple[Node, ...]
    engine: Mapping[str, Any] = field(default_factory=dict)
    picker: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def address(i: int) -> str:
        """Node ``i``'s ``HOST:PORT``."""
        return f"10.0.{i // 250}.{i % 250 + 1}:8000"

    @property
    def versions(self) -> tuple[str, ...]:
        """The model versions, sorted (the first is the default)."""
        return tuple(sorted({n.version for n in self.nodes}))

    def cluster_of(self, i: int) -> str:
        """The Envoy cluster of node ``i``."""
        return cluster_name(SERVICE, self.nodes[i].version)

    @property
    def routes(self) -> dict[str, str]:
        """Model version -> cluster."""
        return {v: cluster_name(SERVICE, v) for v in self.versions}

    def _gpu_memory(self, version: str) -> dict[str, str]:
        """A version of job engines says its servers take GPU memory per request (the engines speak
        vLLM's metric names, and inferlb's default ``vllm`` preset means a preallocated KV-cache pool,
        which the llm engines have)."""
        kinds = {n.kind for n in self.nodes if n.version == version}
        return {"gpu_memory": "per_request"} if kinds == {"job"} else {}

    def config(self, timing: SlowLoopTiming, max_concurrency: Mapping[int, int] | None = None) -> Config:
        """inferlb's config for this cluster (parsed and validated by inferlb's loader).

        ``max_concurrency``: per node index, the value when the node sets none (its engine's batch).
        """
        versions: dict[str, list[dict[str, Any]]] = {}
        for i, node in enumerate(self.nodes):
            endpoint: dict[str, Any] = {"address": self.address(i), "gpu_class": node.gpu_class}
            if node.gpu_memory_mib is not None:
                endpoint["gpu_memory_mib"] = node.gpu_memory_mib
            if node.tier != "edge":
                endpoint["tier"] = node.tier
            limit = node.max_concurrency if node.max_concurrency is not None else (max_concurrency or {}).get(i)
            if limit is not None:
                endpoint["max_concurrency"] = limit
            versions.setdefault(node.version, []).append(endpoint)
        doc = {
            # The lab has no route timeout (a request runs until it ends): the picker's in-flight expiry, which
            # follows Envoy's route timeout, must not count a long-queued request as lost.
            "envoy": {"route_timeout_s": NO_ROUTE_TIMEOUT_S},
            "loop": {"interval_s": timing.interval_s},
            "prometheus": {"window_s": timing.window_s, "scrape_interval_s": timing.scrape_interval_s},
            "engine": {"stale_after_s": timing.stale_after_s, **self.engine},
            "picker": {"access_log_flush_s": timing.access_log_flush_s, **PICKER, **self.picker},
            "services": [{"name": SERVICE, "default_version": self.versions[0], "models": [MODEL],
                          "session_affinity": SESSION_AFFINITY,
                          "versions": [{"name": v, "endpoints": eps, **self._gpu_memory(v)}
                                       for v, eps in sorted(versions.items())]}],
        }
        return parse_config(yaml.safe_dump(doc, sort_keys=False), "<bench lab cluster>", CONFIG_CHECKS)
