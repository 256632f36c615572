"""Benchmarks of inferlb that write BENCHMARKS.md (run through ``inferlb bench ...``).

``bench.quality``: decision quality — what each load-balancing policy's decisions do to latency,
errors, OOMs, sessions and versions on the same seeded traffic.
"""
