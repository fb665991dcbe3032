"""What the benchmarks share: the side-by-side harness of ``benchmarks.compare`` (systems and
their rank-side recipes, the runner, workloads, probes, results and their reports, statistics,
loopback counters, a hand-written AdamW), the sums of ``benchmarks.gpu_check`` (gpu), and the
runtime environment that ships this package to Ray's workers (ray_env)."""
