"""``python -m benchmarks.collectives``: ring reduce-scatter and all-gather against all-reduce
(see zero_ray.bench.collectives); results go to benchmarks/results/collectives.{json,md}.
"""

from __future__ import annotations

import sys

from zero_ray.bench.collectives import main

if __name__ == "__main__":
    sys.exit(main())
