"""lit_cbs benchmarks; run each from the repository root: ``python -m benchmarks.<name>`` (see README.md)."""
