"""Simulated inference engines: pure state machines in the caller's time.

The contract (request, events, stats, KV events, the :class:`~sim.engines.api.Engine` protocol) is
:mod:`sim.engines.api`. Two kinds implement it:

- ``llm`` (:class:`sim.engines.llm.LlmEngine`): continuous batching as vLLM V1 schedules it, with
  BLIS's fitted step times, chunked prefill, KV blocks, automatic prefix caching and recompute
  preemption. ``LlmEngine(gpu="a100", model="llama-3.1-8b", *, max_num_seqs=None,
  max_num_batched_tokens=None, gpu_memory_utilization=0.9, gpu_memory_mib=None,
  prefix_caching=True, kv_events=False, stream=False)``.
- ``job`` (:class:`sim.engines.job.JobEngine`): the seed's per-request GPU server (memory per
  request, the 50 / 95 / 220 ms curve, OOM). ``JobEngine(gpu="a100", *, max_concurrency=8,
  gpu_memory_mib=None, weights_mib=14336, kv_mib_per_token=0.5, stream=False)``.

GPU classes, models and their constants: :mod:`sim.engines.hardware`.
"""
