"""The lab's engines: one ``sim`` engine per node (:mod:`sim.engines`), and the metric values a scrape
of it gives a policy (:class:`bench.lab.policy.Sample`).

``llm`` nodes run :class:`sim.engines.llm.LlmEngine` (vLLM V1's continuous batching on BLIS's step
times), ``job`` nodes :class:`sim.engines.job.JobEngine` (the seed's per-request GPU server). Both
are driven in virtual time by the harness, which owns the clock; neither streams tokens (a request's
tokens are reported once, before it finishes: no policy in the lab reads a token stream).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.lab.cluster import Cluster, Node
from bench.lab.policy import (
    CACHE_BLOCK_SIZE,
    CACHE_BLOCKS,
    GPU_FREE_MIB,
    HELD,
    KV_USAGE,
    PREEMPTIONS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    RUNNING,
    WAITING,
)
from sim.engines.api import Engine, EngineStats

__all__ = ["EngineHandle", "make_engine", "make_engines", "sample_values"]


@dataclass(frozen=True)
class EngineHandle:
    """One node's engine and what the harness reads of its settings.

    Attributes:
        engine: the engine.
        kind: ``llm`` or ``job``.
        block_size: its KV block size (tokens; 16 for a ``job`` engine, which has none).
        kv_tokens: its KV cache (tokens; 0 for a ``job`` engine).
        max_model_len: the longest prompt + output it takes (tokens).
        max_concurrency: the batch it runs at most (requests): the max concurrency its config states.
    """

    engine: Engine
    kind: str
    block_size: int
    kv_tokens: int
    max_model_len: int
    max_concurrency: int


def make_engine(node: Node, kv_events: bool = False) -> EngineHandle:
    """A fresh engine for ``node`` (``kv_events``: record KV-cache events, for the policies that read them).

    Raises:
        ValueError: a node setting the engine refuses (an unknown GPU class, no room for the KV cache).
    """
    options: dict[str, Any] = dict(node.engine)
    if node.gpu_memory_mib is not None:
        options["gpu_memory_mib"] = node.gpu_memory_mib
    if node.kind == "job":
        from sim.engines.job import JobEngine

        engine = JobEngine(node.gpu_class, **options)
        return EngineHandle(engine, "job", 16, 0, 1 << 30, engine.spec.max_concurrency)
    from sim.engines.llm import LlmEngine

    llm = LlmEngine(node.gpu_class, kv_events=kv_events, **options)
    spec = llm.spec
    return EngineHandle(llm, "llm", spec.block_size, spec.num_blocks * spec.block_size, spec.max_model_len,
                        spec.max_num_seqs)


def make_engines(cluster: Cluster, kv_events: bool = False) -> dict[str, EngineHandle]:
    """``{address: handle}`` of every node of ``cluster``, in node order."""
    return {cluster.address(i): make_engine(node, kv_events) for i, node in enumerate(cluster.nodes)}


def sample_values(handle: EngineHandle, stats: EngineStats) -> Mapping[str, float]:
    """What one scrape of the engine shows, under the engines' own metric names (see
    :data:`bench.lab.policy.RUNNING` and the other names there)."""
    return {
        RUNNING: float(stats.running),
        WAITING: float(stats.waiting),
        KV_USAGE: stats.kv_usage,
        PREFIX_QUERIES: float(stats.prefix_queries),
        PREFIX_HITS: float(stats.prefix_hits),
        PREEMPTIONS: float(stats.preemptions),
        CACHE_BLOCKS: float(stats.kv_blocks_total),
        CACHE_BLOCK_SIZE: float(handle.block_size),
        GPU_FREE_MIB: stats.memory_free_mib,
        HELD: float(stats.running + stats.waiting),
    }
