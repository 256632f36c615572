"""Prometheus exposition of one simulated backend, on its own ``CollectorRegistry``.

Names follow real vLLM (labels ``model_name``, ``engine``), as the V1 engine of vLLM v0.10.2
exposes them (``vllm/v1/metrics/loggers.py`` of that release), and the NVIDIA DCGM exporter (labels
``gpu``, ``UUID``, ``modelName``, ``Hostname``), plus a few ``inferlb_sim_*`` counters.
prometheus_client adds ``_total`` to counter names, as vLLM's exposition has them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Histogram buckets in seconds, fine enough to resolve milliseconds.
# fmt: off
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)
#: Token-count histogram buckets (vLLM's 1-2-5 series up to the model length).
TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
#: Per-token latency buckets in seconds (vLLM's, from 10 ms, plus finer ones for a time-compressed sim).
TOKEN_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5,
)
# fmt: on

KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
LEGACY_KV_USAGE_METRIC = "vllm:gpu_cache_usage_perc"

#: Prometheus' text format content type, as prometheus_client produces it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class GaugeSnapshot:
    """Instantaneous node state copied into gauges at scrape time.

    ``kv_usage`` 0-1, ``gpu_util_percent`` 0-100, memory in MiB.
    """

    running: int
    waiting: int
    kv_usage: float
    gpu_util_percent: float
    fb_used_mib: float
    fb_free_mib: float


class SimMetrics:
    """All metric families of one backend. Not thread-safe; use from the event loop."""

    def __init__(
        self,
        *,
        model_name: str,
        gpu_model_name: str,
        gpu_uuid: str,
        hostname: str,
        legacy_kv_name: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        vl = ("model_name", "engine")
        self._vllm = {"model_name": model_name, "engine": "0"}
        self._dcgm = {"gpu": "0", "UUID": gpu_uuid, "modelName": gpu_model_name, "Hostname": hostname}
        dl = tuple(self._dcgm)
        kv_name = LEGACY_KV_USAGE_METRIC if legacy_kv_name else KV_USAGE_METRIC
        self.kv_metric_name = kv_name
        self._synced: dict[Counter, int] = {}

        self.running = Gauge("vllm:num_requests_running", "Requests running on the GPU.", vl, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to run.", vl, registry=reg)
        self.kv_usage = Gauge(kv_name, "KV-cache usage, 0-1 (1 = full).", vl, registry=reg)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, s.",
            vl,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (queue + prefill), s.",
            vl,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting for a running slot, s.",
            vl,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.success = Counter(
            "vllm:request_success_total", "Finished requests.", (*vl, "finished_reason"), registry=reg
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens_total", "Prefill tokens processed.", vl, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens_total", "Generation tokens produced.", vl, registry=reg
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token after the first, per request, s.",
            vl,
            buckets=TOKEN_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two output tokens, s.",
            vl,
            buckets=TOKEN_LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time spent in prefill, per request, s.",
            vl,
            buckets=LATENCY_BUCKETS_S,
            registry=reg,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", vl, buckets=TOKEN_BUCKETS, registry=reg
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", vl, buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens queried.", vl, registry=reg
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in prompt tokens found cached.", vl, registry=reg
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Requests preempted (KV memory given back, recomputed later).", vl,
            registry=reg,
        )
        self.gpu_util = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilisation, percent.", dl, registry=reg)
        self.fb_used = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used, MiB.", dl, registry=reg)
        self.fb_free = Gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free, MiB.", dl, registry=reg)
        self.session_hits = Counter(
            "inferlb_sim_session_cache_hits_total",
            "Requests whose session was warm on this node.",
            registry=reg,
        )
        self.session_misses = Counter(
            "inferlb_sim_session_cache_misses_total", "Requests with a new (cold) session.", registry=reg
        )
        self.oom = Counter("inferlb_sim_oom_total", "Requests refused with CUDA out of memory.", registry=reg)
        # As vLLM's OpenAI server exposes it (prometheus-fastapi-instrumentator, grouped status codes).
        self.http = Counter("http_requests_total", "HTTP responses of the inference API.",
                            ("handler", "method", "status"), registry=reg)
        # Make every labelled series exist from the first scrape (value 0).
        for family in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.e2e,
            self.ttft,
            self.queue_time,
            self.prompt_tokens,
            self.generation_tokens,
            self.tpot,
            self.itl,
            self.prefill_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
        ):
            family.labels(**self._vllm)
        for handler in ("/v1/chat/completions", "/v1/completions"):
            for status in ("2xx", "5xx"):  # a first 5xx must count: rate() drops a series' first sample
                self.http.labels(handler=handler, method="POST", status=status)

    @property
    def gpu_uuid(self) -> str:
        """The ``UUID`` label of the DCGM series."""
        return self._dcgm["UUID"]

    def set_gpu_uuid(self, gpu_uuid: str) -> None:
        """Change the DCGM ``UUID`` label (e.g. once the bound port is known); drops old series."""
        for family in (self.gpu_util, self.fb_used, self.fb_free):
            family.clear()
        self._dcgm["UUID"] = gpu_uuid

    def observe_ttft(self, ttft_s: float) -> None:
        """Record one request's time to first token (s)."""
        self.ttft.labels(**self._vllm).observe(ttft_s)

    def observe_finished(
        self,
        *,
        e2e_s: float,
        queue_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str = "length",
        tpot_s: float | None = None,
        prefill_s: float | None = None,
    ) -> None:
        """Record one successful request (times in seconds; ``tpot_s`` None for a one-token answer)."""
        self.e2e.labels(**self._vllm).observe(e2e_s)
        self.queue_time.labels(**self._vllm).observe(queue_s)
        self.success.labels(**self._vllm, finished_reason=finished_reason).inc()
        self.prompt_tokens.labels(**self._vllm).inc(prompt_tokens)
        self.generation_tokens.labels(**self._vllm).inc(generation_tokens)
        self.request_prompt_tokens.labels(**self._vllm).observe(prompt_tokens)
        self.request_generation_tokens.labels(**self._vllm).observe(generation_tokens)
        if tpot_s is not None:
            self.tpot.labels(**self._vllm).observe(tpot_s)
        if prefill_s is not None:
            self.prefill_time.labels(**self._vllm).observe(prefill_s)

    def sync_engine_counters(self, prefix_queries: int, prefix_hits: int, preemptions: int) -> None:
        """Bring the prefix-cache counters (prompt tokens queried / found cached) and the preemption
        counter up to the engine's totals (they only grow)."""
        for counter, total in ((self.prefix_queries, prefix_queries), (self.prefix_hits, prefix_hits),
                               (self.preemptions, preemptions)):
            child = counter.labels(**self._vllm)
            seen = self._synced.get(counter, 0)
            if total > seen:
                child.inc(total - seen)
                self._synced[counter] = total

    def observe_inter_token(self, gap_s: float, tokens: int = 1) -> None:
        """Record ``tokens`` inter-token gaps of ``gap_s`` seconds each."""
        child = self.itl.labels(**self._vllm)
        for _ in range(tokens):
            child.observe(gap_s)

    def observe_session(self, hit: bool) -> None:
        """Count a session-cache hit or miss."""
        (self.session_hits if hit else self.session_misses).inc()

    def observe_http(self, handler: str, status: int) -> None:
        """Count one inference-API response (``status`` grouped as ``2xx``, ``4xx``, ``5xx``)."""
        self.http.labels(handler=handler, method="POST", status=f"{status // 100}xx").inc()

    def observe_oom(self) -> None:
        """Count a request refused for lack of GPU memory."""
        self.oom.inc()

    def render(self, snapshot: GaugeSnapshot) -> bytes:
        """Set the gauges from ``snapshot`` and return the text exposition (UTF-8 bytes)."""
        self.running.labels(**self._vllm).set(snapshot.running)
        self.waiting.labels(**self._vllm).set(snapshot.waiting)
        self.kv_usage.labels(**self._vllm).set(snapshot.kv_usage)
        self.gpu_util.labels(**self._dcgm).set(snapshot.gpu_util_percent)
        self.fb_used.labels(**self._dcgm).set(snapshot.fb_used_mib)
        self.fb_free.labels(**self._dcgm).set(snapshot.fb_free_mib)
        return generate_latest(self.registry)
