"""PromQL per engine input. ``{w}`` is the window (e.g. ``60s``); every query returns one series per
``instance`` so results join to endpoints by their Prometheus ``instance`` label.

Names come from the engines' docs (see shared/METRICS.md). Renamed metrics are read with PromQL
``or`` so old and new releases both work (case C09: vLLM's ``gpu_cache_usage_perc`` ->
``kv_cache_usage_perc``). A pod with several GPUs takes the worst GPU (max utilisation, min free).
"""

from __future__ import annotations

from types import MappingProxyType

#: field of EndpointStats -> (PromQL template, scale applied to the value)
VLLM_DCGM: MappingProxyType[str, tuple[str, float]] = MappingProxyType(
    {
        "latency_mean_ms": (
            "sum by (instance) (rate(vllm:e2e_request_latency_seconds_sum[{w}]))"
            " / sum by (instance) (rate(vllm:e2e_request_latency_seconds_count[{w}]))",
            1000.0,
        ),
        "latency_p95_ms": (
            "histogram_quantile(0.95, sum by (le, instance) (rate(vllm:e2e_request_latency_seconds_bucket[{w}])))",
            1000.0,
        ),
        "queue": ("sum by (instance) (avg_over_time(vllm:num_requests_waiting[{w}]))", 1.0),
        "running": ("sum by (instance) (avg_over_time(vllm:num_requests_running[{w}]))", 1.0),
        "kv_cache": (
            "max by (instance) (avg_over_time(vllm:kv_cache_usage_perc[{w}]))"
            " or max by (instance) (avg_over_time(vllm:gpu_cache_usage_perc[{w}]))",
            1.0,
        ),
        "gpu_util": ("max by (instance) (avg_over_time(DCGM_FI_DEV_GPU_UTIL[{w}]))", 0.01),
        "gpu_mem_free_mib": ("min by (instance) (DCGM_FI_DEV_FB_FREE)", 1.0),
        "gpu_mem_used_mib": ("max by (instance) (DCGM_FI_DEV_FB_USED)", 1.0),
        # Absent once the target stops answering (Prometheus marks its series stale); the source
        # then ages the last timestamp it saw.
        "last_sample_ts": ("max by (instance) (timestamp(vllm:num_requests_running))", 1.0),
    }
)
