"""Engine presets: which metric names give each engine input (names from docs/metrics-names.md).

A preset is ``{field: SignalSpec}`` (plus ``last_sample_ts``, the newest sample's time). Combine one
serving-engine preset (``vllm``, ``sglang``, ``triton``, ``tgi``) with one GPU preset (``dcgm``,
``triton``, ``none``) via :func:`preset`. Renamed metrics are listed as fallbacks, newest name first
(case C09: vLLM's ``gpu_cache_usage_perc`` -> ``kv_cache_usage_perc``). GPU signals take the worst
GPU of an endpoint (max utilisation, min free memory, max used memory).

No engine exposes a standard "requests refused for lack of GPU memory" counter; every serving
preset reads the simulator's ``inferlb_sim_oom_total`` for ``oom_total`` — point it at your own
counter with a custom query. Inputs a preset cannot give stay ``None`` (plugins skip them).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from xds_server.metrics.promql import render
from xds_server.metrics.signals import (
    Gauge,
    HistogramMean,
    HistogramQuantile,
    Plus,
    Rate,
    Ratio,
    SampleTime,
    Sel,
    SignalSpec,
    Total,
)

SAMPLE_TIME = "last_sample_ts"
_SIM_OOM = SignalSpec(Total(Sel(("inferlb_sim_oom_total",))))


def _s(*names: str, matchers: tuple[tuple[str, str, str], ...] = (), union: bool = False) -> Sel:
    return Sel(tuple(names), matchers, union)


def _latency(base: Sel, scale: float, itl: Sel | None = None) -> dict[str, SignalSpec]:
    out = {
        "latency_mean_ms": SignalSpec(HistogramMean(base), scale),
        "latency_p95_ms": SignalSpec(HistogramQuantile(0.95, base), scale),
    }
    if itl is not None:
        out["itl_mean_ms"] = SignalSpec(HistogramMean(itl), scale)
    return out


_VLLM_RUN, _VLLM_WAIT = _s("vllm:num_requests_running"), _s("vllm:num_requests_waiting")
#: vLLM's OpenAI server counts HTTP responses with prometheus-fastapi-instrumentator (status "2xx", "5xx"...).
_HTTP = _s("http_requests_total")
_HTTP_5XX = _s("http_requests_total", matchers=(("status", "=~", "5.."),))

VLLM: Mapping[str, SignalSpec] = MappingProxyType({
    # vLLM V1's inter-token latency (every gap between two tokens), else V0's per-request time per output token.
    **_latency(_s("vllm:e2e_request_latency_seconds"), 1000.0,
               _s("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")),
    "queue": SignalSpec(Gauge(_VLLM_WAIT)),
    "running": SignalSpec(Gauge(_VLLM_RUN)),
    "in_flight": SignalSpec(Plus((Gauge(_VLLM_RUN, over_window=False), Gauge(_VLLM_WAIT, over_window=False)))),
    "kv_cache": SignalSpec(Gauge(_s("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "max")),
    "request_rate": SignalSpec(Rate(_s("vllm:e2e_request_latency_seconds_count"))),
    "error_rate": SignalSpec(Ratio(_HTTP_5XX, _HTTP)),
    "success_total": SignalSpec(Total(_s("vllm:request_success_total"))),
    "oom_total": _SIM_OOM,
    SAMPLE_TIME: SignalSpec(SampleTime(_VLLM_RUN)),
})

_SG_RUN, _SG_WAIT = _s("sglang:num_running_reqs"), _s("sglang:num_queue_reqs")
SGLANG: Mapping[str, SignalSpec] = MappingProxyType({
    **_latency(_s("sglang:e2e_request_latency_seconds"), 1000.0,
               _s("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")),
    "queue": SignalSpec(Gauge(_SG_WAIT)),
    "running": SignalSpec(Gauge(_SG_RUN)),
    "in_flight": SignalSpec(Plus((Gauge(_SG_RUN, over_window=False), Gauge(_SG_WAIT, over_window=False)))),
    "kv_cache": SignalSpec(Gauge(_s("sglang:token_usage"), "max")),
    "request_rate": SignalSpec(Rate(_s("sglang:e2e_request_latency_seconds_count"))),
    "success_total": SignalSpec(Total(_s("sglang:e2e_request_latency_seconds_count"))),
    "oom_total": _SIM_OOM,
    SAMPLE_TIME: SignalSpec(SampleTime(_SG_RUN)),
})

_TR_PENDING = _s("nv_inference_pending_request_count")
_TR_OK, _TR_FAIL = _s("nv_inference_request_success"), _s("nv_inference_request_failure")
TRITON: Mapping[str, SignalSpec] = MappingProxyType({
    # Triton's durations are cumulative microsecond counters: their rate over the rate of successes.
    "latency_mean_ms": SignalSpec(Ratio(_s("nv_inference_request_duration_us"), _TR_OK, zero_fill=False), 0.001),
    "queue": SignalSpec(Gauge(_TR_PENDING)),
    "in_flight": SignalSpec(Gauge(_TR_PENDING, over_window=False)),
    "request_rate": SignalSpec(Rate(_TR_OK)),
    "error_rate": SignalSpec(Ratio(_TR_FAIL, _s("nv_inference_request_success", "nv_inference_request_failure",
                                                union=True))),
    "success_total": SignalSpec(Total(_TR_OK)),
    "oom_total": _SIM_OOM,
    SAMPLE_TIME: SignalSpec(SampleTime(_TR_PENDING)),
})

_TGI_Q, _TGI_B = _s("tgi_queue_size"), _s("tgi_batch_current_size")
TGI: Mapping[str, SignalSpec] = MappingProxyType({
    **_latency(_s("tgi_request_duration"), 1000.0, _s("tgi_request_mean_time_per_token_duration")),
    "queue": SignalSpec(Gauge(_TGI_Q)),
    "running": SignalSpec(Gauge(_TGI_B)),
    "in_flight": SignalSpec(Plus((Gauge(_TGI_B, over_window=False), Gauge(_TGI_Q, over_window=False)))),
    "request_rate": SignalSpec(Rate(_s("tgi_request_duration_count"))),
    "error_rate": SignalSpec(Ratio(_s("tgi_request_failure"), _s("tgi_request_count"))),
    "success_total": SignalSpec(Total(_s("tgi_request_success"))),
    "oom_total": _SIM_OOM,
    SAMPLE_TIME: SignalSpec(SampleTime(_TGI_Q)),
})

DCGM: Mapping[str, SignalSpec] = MappingProxyType({
    "gpu_util": SignalSpec(Gauge(_s("DCGM_FI_DEV_GPU_UTIL"), "max"), 0.01, gpu=True),  # percent -> 0..1
    "gpu_mem_free_mib": SignalSpec(Gauge(_s("DCGM_FI_DEV_FB_FREE"), "min", over_window=False), gpu=True),
    "gpu_mem_used_mib": SignalSpec(Gauge(_s("DCGM_FI_DEV_FB_USED"), "max", over_window=False), gpu=True),
})

_MIB = 1.0 / (1024 * 1024)
TRITON_GPU: Mapping[str, SignalSpec] = MappingProxyType({
    "gpu_util": SignalSpec(Gauge(_s("nv_gpu_utilization"), "max"), gpu=True),  # already 0..1
    "gpu_mem_free_mib": SignalSpec(Gauge(_s("nv_gpu_memory_total_bytes"), "min", over_window=False,
                                         minus=_s("nv_gpu_memory_used_bytes")), _MIB, gpu=True),
    "gpu_mem_used_mib": SignalSpec(Gauge(_s("nv_gpu_memory_used_bytes"), "max", over_window=False), _MIB,
                                   gpu=True),
})

ENGINE_PRESETS: Mapping[str, Mapping[str, SignalSpec]] = MappingProxyType(
    {"vllm": VLLM, "sglang": SGLANG, "triton": TRITON, "tgi": TGI})
GPU_PRESETS: Mapping[str, Mapping[str, SignalSpec]] = MappingProxyType(
    {"dcgm": DCGM, "triton": TRITON_GPU, "none": MappingProxyType({})})

PREALLOCATED, PER_REQUEST = "preallocated", "per_request"
#: How the GPU memory of each serving-engine preset's servers behaves: the default of a version's
#: ``gpu_memory`` (``services[].versions[].gpu_memory``), the one place it is decided.
#: ``preallocated``: the engine takes its KV-cache pool at start, so GPU memory looks ~full whatever
#: runs and a request needs none of its own; its headroom is the KV-cache usage (``kv_cache``).
#: vLLM sizes the pool from ``--gpu-memory-utilization`` (default 0.9 of the GPU; ``CacheConfig``),
#: SGLang from ``--mem-fraction-static`` (``server_args.py``), TGI from the free memory at warm-up
#: (``flash_causal_lm.py`` ``warmup``, with ``--cuda-memory-fraction``).
#: ``per_request``: each request takes GPU memory of its own while it runs (a model served a request
#: at a time by its own wrapper, most Triton backends): free GPU memory is the headroom. Triton with
#: the TensorRT-LLM backend preallocates (``kv_cache_free_gpu_mem_fraction``): say so per version.
GPU_MEMORY: Mapping[str, str] = MappingProxyType(
    {"vllm": PREALLOCATED, "sglang": PREALLOCATED, "tgi": PREALLOCATED, "triton": PER_REQUEST})


def preset(engine: str = "vllm", gpu: str = "dcgm") -> Mapping[str, SignalSpec]:
    """The specs of serving-engine preset ``engine`` merged with GPU preset ``gpu``.

    Raises:
        KeyError: an unknown preset name (the message lists the known ones).
    """
    if engine not in ENGINE_PRESETS:
        raise KeyError(f"unknown engine preset {engine!r}; known: {sorted(ENGINE_PRESETS)}")
    if gpu not in GPU_PRESETS:
        raise KeyError(f"unknown GPU preset {gpu!r}; known: {sorted(GPU_PRESETS)}")
    return MappingProxyType({**ENGINE_PRESETS[engine], **GPU_PRESETS[gpu]})


def promql_queries(specs: Mapping[str, SignalSpec], gpu_by: tuple[str, ...] = ("instance",)
                   ) -> dict[str, tuple[str, float, tuple[str, ...]]]:
    """``{field: (PromQL template with {w}, scale, join labels)}``: GPU fields grouped by ``gpu_by``."""
    out = {}
    for field, spec in specs.items():
        by = gpu_by if spec.gpu else ("instance",)
        out[field] = (render(spec.signal, by), spec.scale, by)
    return out


#: The default queries (vLLM + DCGM, joined by ``instance``).
VLLM_DCGM: Mapping[str, tuple[str, float, tuple[str, ...]]] = MappingProxyType(promql_queries(preset()))
