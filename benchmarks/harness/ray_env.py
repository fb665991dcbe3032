"""The runtime environment of the Ray jobs the benchmarks start: benchmark code importable on
every worker.

The benchmarks are not installed with zero_ray, yet their rank actors, recipes, probes and
workloads run in Ray workers, which import them by name (module and qualified name, as pickle
refers to any importable code). A worker finds them only through a path of its own: the
driver's working directory, which Ray adds to local workers' paths, is the repository root only
when the benchmark was started from there, and a worker on another node has no checkout at all.
So every job a benchmark starts ships this package to its workers (``py_modules``).

Not by value (``cloudpickle.register_pickle_by_value``, as tests/conftest.py does for test
modules): code pickled by value carries its own copy of its module's globals in every call, and
the probes keep per-process state in module globals (``probe._reset_done``, ``probe.IN_STEP``)
that separate ``__ray_call__`` calls on one actor must share.
"""

from __future__ import annotations

from typing import Any

import benchmarks

# Measurements, not code: kept out of the package Ray uploads to the workers.
EXCLUDES = ("results/", "__pycache__/")


def runtime_env() -> dict[str, Any]:
    """``ray.init``'s runtime_env for a benchmark: one OpenMP thread per worker (every rank runs
    one torch thread) and the ``benchmarks`` package on every worker's path."""
    return {"env_vars": {"OMP_NUM_THREADS": "1"}, "py_modules": [benchmarks], "excludes": list(EXCLUDES)}
