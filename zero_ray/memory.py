"""The paper's memory and communication formulas (re-exported from ``zero_ray.core.memory_formulas``)."""

from zero_ray.core.memory_formulas import *  # noqa: F401,F403
from zero_ray.core.memory_formulas import __all__  # noqa: F401
