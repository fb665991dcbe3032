"""Compute precision and fp16 dynamic loss scaling (pure state, identical on every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_ray.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype, *, what: str = "dtype") -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (and so on)."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ConfigError(f"{what}={name} is not supported; use float32, bfloat16 or float16")
    try:
        return DTYPES[name]
    except KeyError as err:
        raise ConfigError(f"{what}={name!r} is not supported; use one of {sorted(DTYPES)}") from err


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16, with ``torch.amp.GradScaler``'s defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ConfigError(f"{self.init_scale=} must be > 0")
        if not self.growth_factor > 1:
            raise ConfigError(f"{self.growth_factor=} must be > 1")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"{self.backoff_factor=} must be in (0, 1)")
        if self.growth_interval < 1:
            raise ConfigError(f"{self.growth_interval=} must be >= 1")


@dataclass(kw_only=True)
class LossScaler:
    """The scale and its growth tracker. ``enabled=False`` keeps the scale at 1."""

    config: LossScaleConfig
    enabled: bool
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.scale = self.config.init_scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> bool:
        """Record one step's overflow check; returns True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_inf:
            self.scale *= self.config.backoff_factor
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.growth_tracker = 0
        return False
