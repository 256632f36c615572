"""GPU classes and models the engines simulate, and the step-time constants of each pair.

Every figure has its source next to it; docs/simulator.md has the same table.

**Step time** (the ``llm`` engine): one engine step (one forward pass over the batch) takes
``beta0 + beta1 x (uncached prefill tokens in the step) + beta2 x (decode tokens in the step)`` µs,
the form of BLIS's blackbox latency model (repository inference-sim/inference-sim, tag v0.6.7,
``sim/latency/latency.go`` ``BlackboxLatencyModel.StepTime``), with the constants BLIS fitted on
real vLLM v0.8.4 runs of Llama-3.1-8B-Instruct at tensor parallelism 1 (``defaults.yaml`` of that
tag, ``meta-llama/llama-3.1-8b-instruct``, ``A100-80`` and ``H100``).

GPU classes BLIS has no fit for are **derived from the H100 fit** with one rule: the per-step
constant ``beta0`` and the per-decode-token ``beta2`` scale with the memory-bandwidth ratio (a
decode step reads the weights and the KV cache: memory-bound), the per-prefill-token ``beta1``
with the dense BF16 tensor-FLOP ratio (prefill is compute-bound). The H100 fit is the base because
its ``beta0`` is close to the weight-read time (16.06 GB / 3.35 TB/s = 4.79 ms of its 5.75 ms); the
A100 fit carries about 8 ms more per step than its bandwidth explains (16.44 ms against 7.88 ms),
overhead that does not scale with bandwidth. The rule applied to the A100 gives beta0 9.45 ms,
beta1 54.7 µs, beta2 9.9 µs against the fitted 16.44 ms, 47.8 µs, 18.2 µs: prefill within 15 %,
the per-step time about 40 % under the fit (so the derived classes are, if anything, fast).

**KV cache** (the ``llm`` engine): blocks = (GPU memory x ``gpu_memory_utilization`` - weights -
:data:`ACTIVATION_RESERVE_GIB`) / (KV bytes per token x block size), as vLLM sizes it
(``available_kv_cache_memory`` in its memory-profiling log).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

GIB = 1024 ** 3
MIB = 1024 ** 2

#: GPU memory vLLM holds back besides the weights, GiB: non-torch memory 1.79 + PyTorch activation
#: peak 1.26, as vLLM's memory profiling logged them for Meta-Llama-3-8B on an 80 GB GPU
#: (vllm-project/vllm PR #10511, comment of 2024-12-14). Fixed for every class (a simplification:
#: the activation peak grows with ``max_num_batched_tokens``).
ACTIVATION_RESERVE_GIB = 1.79 + 1.26

#: vLLM's default share of GPU memory (``--gpu-memory-utilization``, ``CacheConfig``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuClass:
    """One GPU model.

    ``memory_mib``: total memory (MiB). ``bandwidth_gbs``: memory bandwidth (GB/s) and
    ``bf16_tflops``: dense BF16 tensor throughput (TFLOPS), from NVIDIA's datasheets.
    ``max_num_batched_tokens`` / ``max_num_seqs``: vLLM's defaults for its OpenAI server on this
    GPU (``vllm/engine/arg_utils.py`` ``EngineArgs._set_default_args``, v0.10-v0.11: 8192 / 1024
    on GPUs with >= 70 GiB that are not an A100, else 2048 / 256; the A100 exception is vLLM
    PR #17885). ``job_latency_factor``: the ``job`` engine's time multiplier against an A100.
    """

    key: str
    dcgm_model_name: str
    memory_mib: int
    bandwidth_gbs: float
    bf16_tflops: float
    max_num_batched_tokens: int
    max_num_seqs: int
    job_latency_factor: float


GPU_CLASSES: Mapping[str, GpuClass] = MappingProxyType({g.key: g for g in (
    # A100 80GB SXM: 2 039 GB/s, BF16 312 TFLOPS dense (NVIDIA A100 datasheet).
    GpuClass("a100", "NVIDIA A100-SXM4-80GB", 81920, 2039.0, 312.0, 2048, 256, 1.0),
    # H100 SXM5 80GB: 3.35 TB/s, BF16 1 979 TFLOPS with sparsity = 989 dense (NVIDIA H100 datasheet).
    GpuClass("h100", "NVIDIA H100 80GB HBM3", 81920, 3350.0, 989.0, 8192, 1024, 0.6),
    # A10 24GB: 600 GB/s, BF16 125 TFLOPS dense (250 with sparsity) (NVIDIA A10 datasheet).
    GpuClass("a10", "NVIDIA A10", 24576, 600.0, 125.0, 2048, 256, 2.5),
    # L4 24GB: 300 GB/s, BF16 242 TFLOPS with sparsity = 121 dense (NVIDIA L4 datasheet).
    # Its job factor: the A10's x the A10 / L4 bandwidth ratio (2).
    GpuClass("l4", "NVIDIA L4", 24576, 300.0, 121.0, 2048, 256, 5.0),
)})


@dataclass(frozen=True)
class StepCoefficients:
    """Step time ``beta0 + beta1 x prefill tokens + beta2 x decode tokens``, µs; ``source`` says
    where the numbers come from."""

    beta0_us: float
    beta1_us: float
    beta2_us: float
    source: str

    def step_s(self, prefill_tokens: float, decode_tokens: float) -> float:
        """One step's time, s."""
        return (self.beta0_us + self.beta1_us * prefill_tokens + self.beta2_us * decode_tokens) * 1e-6


@dataclass(frozen=True)
class ModelSpec:
    """One served model: ``kv_bytes_per_token`` (2 x layers x KV heads x head dim x bytes per
    value), ``weights_gib`` (GPU memory of the weights), ``max_model_len`` (its context, tokens),
    ``fitted``: measured step-time constants per GPU class (the others are derived, see the module
    docstring), ``base_gpu``: the fit the derivation starts from."""

    key: str
    hf_name: str
    kv_bytes_per_token: int
    weights_gib: float
    max_model_len: int
    fitted: Mapping[str, StepCoefficients]
    base_gpu: str


_BLIS = "BLIS v0.6.7 defaults.yaml (vLLM v0.8.4, TP 1)"

MODELS: Mapping[str, ModelSpec] = MappingProxyType({m.key: m for m in (
    ModelSpec(
        key="llama-3.1-8b",
        hf_name="meta-llama/Llama-3.1-8B-Instruct",
        # config.json: 32 layers, 8 KV heads (GQA), head dim 4096 / 32 = 128, bf16:
        # 2 x 32 x 8 x 128 x 2 bytes = 131 072 bytes = 128 KiB per token.
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
        # 8.03 B parameters x 2 bytes; vLLM logs "model weights take 14.96GiB" (PR #10511).
        weights_gib=14.96,
        max_model_len=131072,  # config.json max_position_embeddings
        fitted=MappingProxyType({
            "a100": StepCoefficients(16441.531547147923, 47.837412108198656, 18.20560632171683,
                                     f"{_BLIS}, A100-80"),
            "h100": StepCoefficients(5752.705191348184, 17.25086436834028, 5.999143920128404,
                                     f"{_BLIS}, H100"),
        }),
        base_gpu="h100",
    ),
)})

DEFAULT_MODEL = "llama-3.1-8b"


def step_coefficients(model: ModelSpec, gpu: GpuClass) -> StepCoefficients:
    """The step-time constants of ``model`` on ``gpu``: the fit when there is one, else derived
    from ``model.base_gpu``'s fit (bandwidth ratio for beta0 and beta2, BF16 FLOP ratio for beta1)."""
    fit = model.fitted.get(gpu.key)
    if fit is not None:
        return fit
    base_gpu = GPU_CLASSES[model.base_gpu]
    base = model.fitted[model.base_gpu]
    bw = base_gpu.bandwidth_gbs / gpu.bandwidth_gbs
    flops = base_gpu.bf16_tflops / gpu.bf16_tflops
    return StepCoefficients(base.beta0_us * bw, base.beta1_us * flops, base.beta2_us * bw,
                            f"derived from the {base_gpu.key} fit: beta0, beta2 x {bw:.3f} (bandwidth), "
                            f"beta1 x {flops:.3f} (BF16 FLOPS)")


def kv_cache_blocks(model: ModelSpec, gpu_memory_mib: float, *, block_size: int,
                    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
    """KV blocks of ``block_size`` tokens that fit beside ``model`` on a GPU of ``gpu_memory_mib``
    MiB: (memory x utilization - weights - activation reserve) / (KV bytes per token x block size).
    Raises ValueError when nothing is left for the KV cache (vLLM refuses to start then)."""
    available = (gpu_memory_mib * MIB * gpu_memory_utilization
                 - (model.weights_gib + ACTIVATION_RESERVE_GIB) * GIB)
    blocks = int(available // (model.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: {gpu_memory_mib:g} MiB x {gpu_memory_utilization:g} holds the "
            f"{model.key} weights ({model.weights_gib:g} GiB) and the activation reserve "
            f"({ACTIVATION_RESERVE_GIB:g} GiB) with nothing to spare")
    return blocks


#: The request the GPU classes' relative capacities are stated for (tokens): the defaults of vLLM's
#: serving benchmark's random dataset (vllm-project/vllm ``benchmarks/benchmark_serving.py``,
#: ``--random-input-len`` 1024, ``--random-output-len`` 128).
REFERENCE_PROMPT_TOKENS = 1024
REFERENCE_OUTPUT_TOKENS = 128


def saturated_requests_per_s(model: ModelSpec, gpu: GpuClass, *, block_size: int,
                             prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
                             output_tokens: int = REFERENCE_OUTPUT_TOKENS) -> float:
    """Requests/s one ``llm`` engine of ``model`` on ``gpu`` completes when saturated with identical
    requests of ``prompt_tokens`` + ``output_tokens`` (no prefix-cache hits).

    Steady state at batch ``B`` = min(``gpu.max_num_seqs``, KV-cache tokens // (prompt + output)):
    as many running requests as the slots and the KV cache (:func:`kv_cache_blocks` x
    ``block_size``, every request holding its whole context) allow. Each request costs its prefill
    (``beta1`` x prompt), its decode tokens (``beta2`` x output) and its share of the per-step
    constant (``beta0`` x output / B: it takes part in ``output`` steps of ``B`` requests), so
    ``rate = 1e6 / (beta1 P + beta2 O + beta0 O / B)`` (µs -> s). Raises ValueError when not even
    one request fits in the KV cache."""
    tokens = kv_cache_blocks(model, gpu.memory_mib, block_size=block_size) * block_size
    batch = min(gpu.max_num_seqs, tokens // (prompt_tokens + output_tokens))
    if batch < 1:
        raise ValueError(f"one request of {prompt_tokens + output_tokens} tokens does not fit in the "
                         f"{tokens}-token KV cache of {model.key} on {gpu.key}")
    c = step_coefficients(model, gpu)
    return 1e6 / (c.beta1_us * prompt_tokens + c.beta2_us * output_tokens + c.beta0_us * output_tokens / batch)


def relative_capacity(gpu: str, *, block_size: int, model: str = DEFAULT_MODEL) -> float:
    """:func:`saturated_requests_per_s` of ``gpu`` over the A100's, for ``model`` and the reference
    request: the ``capacity`` of inferlb's GPU classes (``xds_server.config.model.DEFAULT_GPU_CLASSES``).

    >>> round(relative_capacity("h100", block_size=16), 2), round(relative_capacity("l4", block_size=16), 2)
    (2.92, 0.12)
    """
    m = MODELS[model]
    return (saturated_requests_per_s(m, GPU_CLASSES[gpu], block_size=block_size)
            / saturated_requests_per_s(m, GPU_CLASSES["a100"], block_size=block_size))
