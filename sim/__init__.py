"""Simulated vLLM-style GPU inference backend (one node, one GPU) for demos, tests and benchmarks.

Modules: ``model`` (pure latency/memory/session model), ``config`` (BackendConfig), ``gate``
(FIFO concurrency gate), ``faults`` (runtime fault controls), ``protocol`` (OpenAI request/response
bodies), ``metrics`` (Prometheus exposition), ``node`` (one simulated node), ``server`` (aiohttp
app), ``cli`` (``inferlb sim-backend``).
"""
