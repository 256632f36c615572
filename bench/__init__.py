"""Benchmarks that write BENCHMARKS.md: ``inferlb bench ...`` (see each module)."""
