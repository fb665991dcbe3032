"""``python -m benchmarks.compare``: the side-by-side benchmark (see zero_ray.bench.compare).

Same as ``zero-ray bench``; results go to benchmarks/results/ by default.
"""

from __future__ import annotations

import sys

from zero_ray.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
