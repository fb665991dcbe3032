"""zero_ray: ZeRO (Rajbhandari et al.) stages 0-3 as a Ray service."""

from __future__ import annotations

from zero_ray.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    ModelError,
    OwnerError,
    OwnerLostError,
    ResourceError,
    ZeroRayError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "ModelError",
    "OwnerError",
    "OwnerLostError",
    "ResourceError",
    "ZeroRayError",
    "__version__",
]
