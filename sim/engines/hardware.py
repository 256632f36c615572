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

**FP8 checkpoints** (W8A8: FP8 weights and activations in the linear layers of the transformer
blocks, the embeddings and ``lm_head`` kept in BF16, as Neural Magic's and NVIDIA's FP8 model cards
state) are **derived from their BF16 model's constants** on the same GPU: ``beta0`` (a decode step's
fixed cost, the weight read: see above) x the ratio of the weights' bytes; ``beta1`` (prefill,
compute-bound) x the GPU's dense BF16 / dense FP8 tensor-FLOP ratio when the GPU computes in FP8
(vLLM runs W8A8 on compute capability >= 8.9: Ada Lovelace, Hopper; on Ampere it runs the weights
only in FP8 (W8A16, FP8 Marlin) and computes in BF16: ``beta1`` unchanged; vLLM docs,
features/quantization/fp8); ``beta2`` unchanged (its per-token work is not the weight read).

**KV cache** (the ``llm`` engine): blocks = (GPU memory x ``gpu_memory_utilization`` - weights -
:data:`ACTIVATION_RESERVE_GIB`) / (KV bytes per token x block size), as vLLM sizes it
(``available_kv_cache_memory`` in its memory-profiling log). vLLM's ``--kv-cache-dtype fp8`` stores
one byte per value instead of the model's two: half the bytes per token (:data:`KV_CACHE_DTYPES`).
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

    ``memory_mib``: total memory (MiB). ``bandwidth_gbs``: memory bandwidth (GB/s),
    ``bf16_tflops``: dense BF16 tensor throughput (TFLOPS) and ``fp8_tflops``: dense FP8 tensor
    throughput (TFLOPS; None: no FP8 tensor cores, compute capability < 8.9), from NVIDIA's datasheets.
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
    fp8_tflops: float | None
    max_num_batched_tokens: int
    max_num_seqs: int
    job_latency_factor: float


GPU_CLASSES: Mapping[str, GpuClass] = MappingProxyType({g.key: g for g in (
    # A100 80GB SXM: 2 039 GB/s, BF16 312 TFLOPS dense, no FP8 (NVIDIA A100 datasheet).
    GpuClass("a100", "NVIDIA A100-SXM4-80GB", 81920, 2039.0, 312.0, None, 2048, 256, 1.0),
    # H100 SXM5 80GB: 3.35 TB/s, BF16 1 979 TFLOPS with sparsity = 989 dense, FP8 3 958 with
    # sparsity = 1 979 dense (NVIDIA H100 datasheet).
    GpuClass("h100", "NVIDIA H100 80GB HBM3", 81920, 3350.0, 989.0, 1979.0, 8192, 1024, 0.6),
    # A10 24GB: 600 GB/s, BF16 125 TFLOPS dense (250 with sparsity), no FP8 (NVIDIA A10 datasheet).
    GpuClass("a10", "NVIDIA A10", 24576, 600.0, 125.0, None, 2048, 256, 2.5),
    # L4 24GB: 300 GB/s, BF16 242 TFLOPS with sparsity = 121 dense, FP8 485 with sparsity = 242.5
    # dense (NVIDIA L4 datasheet). Its job factor: the A10's x the A10 / L4 bandwidth ratio (2).
    GpuClass("l4", "NVIDIA L4", 24576, 300.0, 121.0, 242.5, 2048, 256, 5.0),
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
    value, at the model's own dtype), ``weights_gib`` (GPU memory of the weights), ``max_model_len``
    (its context, tokens), ``fitted``: measured step-time constants per GPU class (the others are
    derived, see the module docstring), ``base_gpu``: the fit the derivation starts from;
    ``fp8_of``: for an FP8 (W8A8) checkpoint, the key of the BF16 model it quantizes (its constants
    are derived from that model's, see the module docstring), else None."""

    key: str
    hf_name: str
    kv_bytes_per_token: int
    weights_gib: float
    max_model_len: int
    fitted: Mapping[str, StepCoefficients]
    base_gpu: str
    fp8_of: str | None = None


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
    ModelSpec(
        key="llama-3.1-8b-fp8",
        hf_name="neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8",  # KubeAI's ShareGPT benchmark model
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # BF16 KV unless the engine runs --kv-cache-dtype fp8
        # Derived: the BF16 weights (14.96 GiB) with the transformer blocks' linear layers in FP8 (one
        # byte instead of two) and the embeddings and lm_head (2 x 128 256 x 4 096 parameters =
        # 1.96 GiB in BF16) kept: 1.96 + (14.96 - 1.96) / 2 = 8.46 GiB (the model card: ~50 % less).
        weights_gib=1.96 + (14.96 - 1.96) / 2,
        max_model_len=131072,
        fitted=MappingProxyType({}),
        base_gpu="h100",
        fp8_of="llama-3.1-8b",
    ),
)})

DEFAULT_MODEL = "llama-3.1-8b"

#: Bytes per KV value of vLLM's ``--kv-cache-dtype`` choices, as a share of the model's own
#: (``auto``: the model's dtype, BF16 here; ``fp8``: one byte, half).
KV_CACHE_DTYPES: Mapping[str, float] = MappingProxyType({"auto": 1.0, "fp8": 0.5})


def step_coefficients(model: ModelSpec, gpu: GpuClass) -> StepCoefficients:
    """The step-time constants of ``model`` on ``gpu``: the fit when there is one, else derived
    from ``model.base_gpu``'s fit (bandwidth ratio for beta0 and beta2, BF16 FLOP ratio for beta1);
    an FP8 checkpoint's from its BF16 model's on ``gpu`` (weight-byte ratio for beta0, BF16 / FP8
    FLOP ratio for beta1 where ``gpu`` computes in FP8; the module docstring)."""
    if model.fp8_of is not None:
        bf16 = MODELS[model.fp8_of]
        b = step_coefficients(bf16, gpu)
        weights = model.weights_gib / bf16.weights_gib
        flops = gpu.bf16_tflops / gpu.fp8_tflops if gpu.fp8_tflops else 1.0
        return StepCoefficients(b.beta0_us * weights, b.beta1_us * flops, b.beta2_us,
                                f"FP8 of {bf16.key} ({b.source}): beta0 x {weights:.3f} (weight bytes), "
                                f"beta1 x {flops:.3f} (BF16 / FP8 FLOPS)")
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
                    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                    kv_cache_dtype: str = "auto") -> int:
    """KV blocks of ``block_size`` tokens that fit beside ``model`` on a GPU of ``gpu_memory_mib``
    MiB: (memory x utilization - weights - activation reserve) / (KV bytes per token x block size),
    the bytes per token scaled by ``kv_cache_dtype`` (:data:`KV_CACHE_DTYPES`).
    Raises ValueError when nothing is left for the KV cache (vLLM refuses to start then), or for an
    unknown ``kv_cache_dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    available = (gpu_memory_mib * MIB * gpu_memory_utilization
                 - (model.weights_gib + ACTIVATION_RESERVE_GIB) * GIB)
    blocks = int(available // (model.kv_bytes_per_token * KV_CACHE_DTYPES[kv_cache_dtype] * block_size))
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
