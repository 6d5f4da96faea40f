"""Benchmark harness: `tiered bench ...` (figures go to benchmarks/RESULTS.md)."""
