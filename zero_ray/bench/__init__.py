"""Baselines and benchmarks: the same training run in plain PyTorch systems for comparison."""
