"""Benchmarks runnable without asv: ``python -m arraytrain.bench``."""
