"""Benchmarks runnable from a checkout: ``python -m benchmarks.compare``."""
