"""The lab's workloads (one module each): seeded request generators and trace readers.

:mod:`~bench.lab.workloads.base` holds the contract (:class:`~bench.lab.workloads.base.Workload`,
:class:`~bench.lab.workloads.base.Draft`); :mod:`~bench.lab.workloads.tokens` the shared prompt
pieces. Generators: ``shared_prefix`` (llm-d's groups sharing system prompts), ``sharegpt_chat``
(real ShareGPT conversations), ``uniform`` (nothing shared), ``sessions`` (the seed's trap
traffic). Traces: ``trace`` (JSONL, docs/benchmarks.md), ``mooncake`` (block-hash ids).
"""
