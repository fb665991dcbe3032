"""Learning-rate schedules: a step index in, a multiplier of the optimizer's ``lr`` out.

The driver evaluates the schedule and sends each step's lr with the step, so every rank uses
the same value. Step ``t`` (0-based) uses ``lr * schedule(t)``, as ``torch.optim.lr_scheduler
.LambdaLR`` does when ``scheduler.step()`` follows ``optimizer.step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Constant:
    """The optimizer's lr at every step."""

    def __call__(self, step: int) -> float:
        return 1.0


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    """Linear warm-up from ``1/(warmup_steps+1)`` to 1, then cosine decay to ``min_ratio``."""

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

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
