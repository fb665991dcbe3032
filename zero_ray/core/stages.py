"""What each ZeRO stage partitions, written once as data.

Everything else derives from these three residencies: which slice a rank updates, whether
gradients are all-reduced or reduce-scattered, when they are reduced, and whether updated
parameters must be all-gathered afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zero_ray.errors import ConfigError


class Residency(enum.Enum):
    """Whether every rank holds all of a model-state category or only its own partition."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


class GradReduction(enum.Enum):
    """How gradients are combined across ranks."""

    ALL_REDUCE = "all_reduce"  # every rank ends with the full summed gradient
    REDUCE_SCATTER = "reduce_scatter"  # each rank ends with the sum of its own slice


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One ZeRO stage: the residency of optimizer state, gradients and parameters."""

    stage: int
    name: str
    optimizer: Residency
    gradients: Residency
    parameters: Residency

    @property
    def grad_reduction(self) -> GradReduction:
        # A replicated optimizer needs the whole gradient; a sharded one only its slice.
        if self.optimizer is Residency.REPLICATED:
            return GradReduction.ALL_REDUCE
        return GradReduction.REDUCE_SCATTER

    @property
    def reduce_every_micro_batch(self) -> bool:
        """Sharded gradients leave no full buffer to accumulate into, so each micro-batch's
        gradients are reduce-scattered as backward produces them."""
        return self.gradients is Residency.SHARDED

    @property
    def gather_after_update(self) -> bool:
        """Replicated parameters updated only on their owner's slice must be all-gathered."""
        return self.optimizer is Residency.SHARDED and self.parameters is Residency.REPLICATED

    @property
    def updates_whole_buffer(self) -> bool:
        return self.optimizer is Residency.REPLICATED

    @property
    def communication_multiple(self) -> int:
        """Elements sent per step in units of Ψ before the ring factor (N-1)/N: gradients
        reduced (Ψ) and parameters gathered (Ψ), plus a second gather for backward (Ψ) when
        parameters are sharded (the paper's section 7)."""
        return 3 if self.parameters is Residency.SHARDED else 2


_R, _S = Residency.REPLICATED, Residency.SHARDED

STAGES: dict[int, StagePlan] = {
    0: StagePlan(stage=0, name="DP", optimizer=_R, gradients=_R, parameters=_R),
    1: StagePlan(stage=1, name="P_os", optimizer=_S, gradients=_R, parameters=_R),
    2: StagePlan(stage=2, name="P_os+g", optimizer=_S, gradients=_S, parameters=_R),
    3: StagePlan(stage=3, name="P_os+g+p", optimizer=_S, gradients=_S, parameters=_S),
}


def stage_plan(stage: int) -> StagePlan:
    """The plan of ``stage`` (0..3)."""
    try:
        return STAGES[stage]
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{stage=} is outside 0..3; choose 0 (DP), 1, 2 or 3") from err
