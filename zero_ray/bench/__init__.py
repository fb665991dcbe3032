"""Fault injection for the tests and the recovery benchmark (``faults``), kept here while it is
redesigned. The benchmark harness is in ``benchmarks/`` (a source checkout), the reference runs
in ``zero_ray.testing``."""
