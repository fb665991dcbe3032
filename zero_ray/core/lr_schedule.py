"""A learning-rate schedule convenience: a factory of torch's own ``LambdaLR``.

``lr_scheduler=`` takes any factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``;
``WarmupCosine(...)`` is one, for the common linear warm-up and cosine decay. Step ``t``
(0-based, counting optimizer steps) uses ``lr * multiplier(t)``: ``LambdaLR`` stepped once after
each ``optimizer.step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    """Linear warm-up from ``1/(warmup_steps+1)`` to 1, then cosine decay to ``min_ratio``, as
    a factory of ``torch.optim.lr_scheduler.LambdaLR``."""

    warmup_steps: int = 0
    total_steps: int
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"{self.warmup_steps=} must be >= 0")
        if self.total_steps <= self.warmup_steps:
            raise ConfigError(f"{self.total_steps=} must exceed {self.warmup_steps=}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ConfigError(f"{self.min_ratio=} must be in [0, 1]")

    def multiplier(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.multiplier)
