"""Configuration of one simulated inference backend (one node, one GPU)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sim.engines.hardware import DEFAULT_MODEL, GPU_CLASSES, MODELS
from sim.engines.job import DEFAULT_KV_MIB_PER_TOKEN, DEFAULT_WEIGHTS_MIB

#: The engine kinds (:mod:`sim.engines`): ``llm`` continuous batching, ``job`` the per-request server.
ENGINES = ("llm", "job")


@dataclass
class BackendConfig:
    """Everything that defines one simulated backend.

    Units: memory in MiB, latency in ms, probabilities 0-1. ``port=0`` asks the OS for a free
    port (the bound port is reported by :func:`sim.server.start_backend`).
    ``gpu_memory_mib=None`` means "the GPU class default". ``push_status``: ``HOST:PORT`` of an
    inferlb ``NodeStatusService`` to stream this node's status to every ``push_interval_s`` (s), as
    ``push_instance`` (default: the bound ``HOST:PORT``). ``etcd``: etcd client URLs (comma-separated) to register
    in (:mod:`sim.etcd`): key ``etcd_prefix + address`` (``etcd_address``, default the bound
    ``HOST:PORT``) on a lease of ``etcd_ttl_s`` s, as service ``etcd_service`` (default: the model
    name), status rewritten every ``etcd_status_interval_s`` s, ``etcd_drain_s`` s of drain at shutdown,
    as etcd user ``etcd_user`` (``NAME:PASSWORD``; default: no authentication).

    ``engine``: ``llm`` (continuous batching, :mod:`sim.engines.llm`, serving ``model``) or ``job``
    (the seed's per-request server, :mod:`sim.engines.job`). ``max_concurrency``: requests run at
    once (llm: vLLM's ``max_num_seqs``; None: vLLM's default for the GPU, job: 8);
    ``max_num_batched_tokens``: the llm engine's token budget per step (None: vLLM's default).
    ``prefix_caching`` and ``block_size``: the llm engine's automatic prefix caching and KV block
    size (tokens). ``weights_mib`` and ``kv_mib_per_token``: the job engine's model weights and KV
    memory per prompt or generated token (MiB; the llm engine takes both from ``model``).
    ``session_history_tokens``: tokens of conversation history a session key stands for (the
    session-keyed cache as a special case of the prefix cache; 0 = none).
    ``default_max_tokens``: a request without ``max_tokens`` generates a seeded 1..this many tokens.
    ``kv_events_endpoint``: publish the llm engine's KV-cache events as vLLM does on a ZMQ PUB socket
    bound here (``tcp://HOST:PORT``, :mod:`sim.kv_publish`; None: not published).
    ``kv_events_opaque``: publish each block's hash as vLLM's sha256 hashes look to a consumer: 32
    bytes no one can compute from the prompt (a digest of the engine's key under a seed random per
    start), not the engine's key (:class:`sim.kv_publish.KvEventPublisher`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    gpu_class: str = "a100"
    version: str = "v1"
    model_name: str = "sim-7b"
    engine: str = "llm"
    model: str = DEFAULT_MODEL
    gpu_memory_mib: float | None = None
    weights_mib: float = DEFAULT_WEIGHTS_MIB
    kv_mib_per_token: float = DEFAULT_KV_MIB_PER_TOKEN
    prefix_caching: bool = True
    block_size: int = 16
    session_history_tokens: int = 400
    default_max_tokens: int = 128
    max_concurrency: int | None = None
    max_num_batched_tokens: int | None = None
    long_tail: float = 0.0
    legacy_metrics: bool = False
    seed: int | None = None
    time_scale: float = 1.0
    push_status: str | None = None
    push_interval_s: float = 0.5
    push_instance: str | None = None
    etcd: str | None = None
    etcd_prefix: str = "/inferlb/endpoints/"
    etcd_ttl_s: int = 10
    etcd_service: str | None = None
    etcd_address: str | None = None
    etcd_status_interval_s: float = 5.0
    etcd_drain_s: float = 2.0
    etcd_user: str | None = field(default=None, repr=False)
    kv_events_endpoint: str | None = None
    kv_events_opaque: bool = False
    hostname: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.gpu_class not in GPU_CLASSES:
            raise ValueError(f"gpu_class must be one of {sorted(GPU_CLASSES)}, got {self.gpu_class!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.gpu_memory_mib is None:
            self.gpu_memory_mib = float(GPU_CLASSES[self.gpu_class].memory_mib)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        if self.engine == "job" and (self.weights_mib < 0 or self.gpu_memory_mib <= self.weights_mib):
            raise ValueError(
                f"gpu_memory_mib ({self.gpu_memory_mib}) must exceed the model weights "
                f"({self.weights_mib} MiB)"
            )
        if self.kv_mib_per_token < 0:
            raise ValueError("kv_mib_per_token must be >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.long_tail <= 1.0:
            raise ValueError("long_tail must be a probability in 0-1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not 1 <= self.block_size <= 1024:
            raise ValueError("block_size must be 1-1024 tokens")
        if self.session_history_tokens < 0:
            raise ValueError("session_history_tokens must be >= 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if not 0.01 <= self.push_interval_s <= 60:
            raise ValueError("push_interval_s must be 0.01-60 s")
        if self.etcd is not None and not all(u.strip().startswith(("http://", "https://"))
                                             for u in self.etcd.split(",")):
            raise ValueError(f"etcd must be http(s):// URLs, comma-separated, got {self.etcd!r}")
        if not self.etcd_prefix:
            raise ValueError("etcd_prefix must not be empty")
        if not 1 <= self.etcd_ttl_s <= 3600:
            raise ValueError("etcd_ttl_s must be 1-3600 s")
        if not 0.1 <= self.etcd_status_interval_s <= 3600:
            raise ValueError("etcd_status_interval_s must be 0.1-3600 s")
        if self.etcd_drain_s < 0:
            raise ValueError("etcd_drain_s must be >= 0")
        if self.etcd_user is not None and not self.etcd_user.partition(":")[0]:
            raise ValueError("etcd_user must be NAME:PASSWORD")

    @property
    def gpu_memory_total_mib(self) -> float:
        """Total GPU memory in MiB (class default or the explicit override)."""
        assert self.gpu_memory_mib is not None
        return self.gpu_memory_mib
