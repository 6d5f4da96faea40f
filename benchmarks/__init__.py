"""The benchmark harness: `python -m benchmarks ...` (figures go to benchmarks/RESULTS.md)."""
