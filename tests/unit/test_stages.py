"""Stage plans: what each stage shards, and what follows from it."""

from __future__ import annotations

import pytest

from zero_ray.core.stages import GradReduction, Residency, stage_plan
from zero_ray.errors import ConfigError

S, R = Residency.SHARDED, Residency.REPLICATED


@pytest.mark.parametrize(("stage", "residency", "reduction", "per_micro", "gather"), [
    (0, (R, R, R), GradReduction.ALL_REDUCE, False, False),
    (1, (S, R, R), GradReduction.REDUCE_SCATTER, False, True),
    (2, (S, S, R), GradReduction.REDUCE_SCATTER, True, True),
    (3, (S, S, S), GradReduction.REDUCE_SCATTER, True, False),
])
def test_plans(stage: int, residency: tuple[Residency, ...], reduction: GradReduction, per_micro: bool,
               gather: bool) -> None:
    plan = stage_plan(stage)
    assert (plan.optimizer, plan.gradients, plan.parameters) == residency
    assert plan.grad_reduction is reduction
    assert plan.reduce_every_micro_batch is per_micro
    assert plan.gather_after_update is gather


@pytest.mark.parametrize("bad", [-1, 4, "2", None])
def test_unknown_stage_names_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="outside 0..3"):
        stage_plan(bad)  # type: ignore[arg-type]
