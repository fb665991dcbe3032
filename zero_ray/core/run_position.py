"""Where a run is: the one step counter.

The driver's ``Position`` is the truth. Owners hold a copy (set from each step's arguments, a
loaded checkpoint, or the state a resize or restore moved), checkpoints record it and an
attaching driver reads it back from the owners; nothing else counts steps. (How many updates a
parameter has had is torch's per-parameter ``state["step"]``, which is optimizer state, not a
position.)

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Position:
    """Steps completed (an fp16 overflow or a non-finite step skipped under
    ``on_nonfinite="skip"`` counts: its batch was consumed) and the samples those steps read.
    A step refused under ``on_nonfinite="raise"`` is not completed and moves nothing."""

    step: int = 0
    samples_seen: int = 0

    def __post_init__(self) -> None:
        for name in ("step", "samples_seen"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"position {name}={value!r} must be an integer >= 0")

    def after(self, samples: int) -> Position:
        """The position once one more step of ``samples`` samples has completed."""
        return Position(step=self.step + 1, samples_seen=self.samples_seen + samples)

    def to_data(self) -> dict[str, int]:
        return {"step": self.step, "samples_seen": self.samples_seen}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Position:
        return cls(step=int(data["step"]), samples_seen=int(data["samples_seen"]))
