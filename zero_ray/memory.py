"""The paper's memory and communication formulas (re-exported from ``zero_ray.core.memory``)."""

from zero_ray.core.memory import *  # noqa: F401,F403
from zero_ray.core.memory import __all__  # noqa: F401
