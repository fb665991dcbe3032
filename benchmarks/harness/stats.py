"""Summaries of timing samples (pure Python: no torch, no ray)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Median, minimum and maximum of ``n`` samples (seconds, bytes, ...)."""

    median: float
    min: float
    max: float
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"a Summary needs at least one sample, got n={self.n}")
        if not self.min <= self.median <= self.max:
            raise ConfigError(f"inconsistent Summary: min={self.min} median={self.median} max={self.max}")

    def scaled(self, factor: float) -> Summary:
        """The same summary in other units (e.g. seconds to milliseconds)."""
        return Summary(median=self.median * factor, min=self.min * factor, max=self.max * factor, n=self.n)


def summarise(samples: Iterable[float]) -> Summary:
    """Median (the mean of the two middle values for an even count), min and max.

    The median rather than the mean because a shared machine produces occasional long steps
    (another process takes the core) that would drag a mean but say nothing about the system.
    """
    values = [float(v) for v in samples]
    if not values:
        raise ConfigError("cannot summarise zero samples; run at least one timed step")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ConfigError(f"samples must be finite numbers; got {bad[:3]}")
    return Summary(median=statistics.median(values), min=min(values), max=max(values), n=len(values))
