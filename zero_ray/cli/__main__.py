"""`python -m zero_ray.cli ...`: the same as the `zero-ray` console script."""

from __future__ import annotations

import sys

from zero_ray.cli import main

sys.exit(main())
