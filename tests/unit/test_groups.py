"""Group policies, group planning and the per-step usage marks: pure, no Ray, milliseconds."""

from __future__ import annotations


import pytest

from zero_ray.core.group_policy import GradFlow, ParamResidency, group_policy, plan_groups, size_buckets
from zero_ray.core.stages import GradReduction, stage_plan
from zero_ray.core.stage3_units import UnitPlan, UnitSpec
from zero_ray.core.updated_params import digits_per_value, pack_marks, unpack_marks
from zero_ray.errors import ConfigError

W, P, A, B = ParamResidency.WHOLE, ParamResidency.PER_USE, GradFlow.ACCUMULATE, GradFlow.PER_MICRO_BATCH


@pytest.mark.parametrize(("stage", "params", "grads", "reduction", "whole", "gather"), [
    (0, W, A, GradReduction.ALL_REDUCE, True, False),
    (1, W, A, GradReduction.REDUCE_SCATTER, False, True),
    (2, W, B, GradReduction.REDUCE_SCATTER, False, True),
    (3, P, B, GradReduction.REDUCE_SCATTER, False, False),
])
def test_trainable_policy_of_each_stage(stage: int, params: ParamResidency, grads: GradFlow,
                                        reduction: GradReduction, whole: bool, gather: bool) -> None:
    policy = group_policy(stage_plan(stage), trainable=True)
    assert (policy.params, policy.grads, policy.reduction) == (params, grads, reduction)
    assert (policy.update_whole, policy.gather_after_update, policy.trainable, policy.label) == (whole, gather, True, "")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_groups_keep_their_residency_and_have_no_gradients(stage: int) -> None:
    trained, frozen = (group_policy(stage_plan(stage), trainable=t) for t in (True, False))
    assert frozen.grads is GradFlow.NONE and frozen.reduction is None and not frozen.trainable
    assert frozen.params is trained.params  # stage 3 still partitions and gathers them
    assert frozen.update_whole == trained.update_whole  # the range a rank saves
    assert frozen.gather_after_update == trained.gather_after_update  # after a restore


def test_persistent_parameters_follow_stage_1() -> None:
    persistent = group_policy(stage_plan(3), trainable=True, persistent=True)
    stage1 = group_policy(stage_plan(1), trainable=True)
    assert persistent.params is W and persistent.grads is A and persistent.gather_after_update
    assert (persistent.params, persistent.grads, persistent.reduction, persistent.update_whole) == \
        (stage1.params, stage1.grads, stage1.reduction, stage1.update_whole)
    assert persistent.label == "persistent_"


def test_size_buckets_go_in_reverse_registration_order() -> None:
    assert size_buckets([4, 4, 4, 4], range(4), bucket_numel=8) == [[3, 2], [1, 0]]
    assert size_buckets([10, 1, 1], [0, 2], bucket_numel=5) == [[2], [0]]  # a parameter is never split
    with pytest.raises(ConfigError, match="bucket_numel=0"):
        size_buckets([1], [0], bucket_numel=0)


def test_frozen_parameters_get_buckets_of_their_own_after_the_trainable_ones() -> None:
    shapes = [(4,), (4,), (4,), (4,), (4,)]
    trainable = [False, True, False, True, True]
    groups = plan_groups(stage_plan(2), shapes=shapes, trainable=trainable, bucket_numel=8)
    assert [(g.params, g.policy.trainable) for g in groups] == [((4, 3), True), ((1,), True), ((2, 0), False)]
    assert [g.index for g in groups] == [0, 1, 2] and all(g.unit is None for g in groups)
    # With nothing frozen the buckets are the ones the stage always had.
    everything = plan_groups(stage_plan(2), shapes=shapes, trainable=[True] * 5, bucket_numel=8)
    assert [g.params for g in everything] == [tuple(b) for b in size_buckets([4] * 5, range(5), bucket_numel=8)]


def test_stage3_splits_each_unit_into_trainable_and_frozen_groups() -> None:
    units = UnitPlan(units=(UnitSpec(index=0, path="", params=(0,), numel=4, parent=None, depth=0),
                            UnitSpec(index=1, path="a", params=(1, 2, 3), numel=12, parent=0, depth=1)),
                     persistent=(4, 5), num_params=6)
    trainable = [True, False, True, False, False, True]
    groups = plan_groups(stage_plan(3), shapes=[(4,)] * 6, trainable=trainable, bucket_numel=8, units=units)
    assert [(g.params, g.unit, g.policy.trainable, g.policy.params) for g in groups] == [
        ((0,), 0, True, P), ((2,), 1, True, P), ((1, 3), 1, False, P), ((5,), None, True, W), ((4,), None, False, W)]
    assert groups[3].policy.label == groups[4].policy.label == "persistent_"
    with pytest.raises(ConfigError, match="need a unit plan"):
        plan_groups(stage_plan(3), shapes=[(4,)], trainable=[True], bucket_numel=8)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64, 1000])
def test_marks_summed_over_ranks_unpack_to_any_rank_marked(world_size: int) -> None:
    count = 2 * digits_per_value(world_size) + 3  # several packed floats, the last one partial
    ranks = [[(r * 7 + k * 3) % 5 == 0 for k in range(count)] for r in range(world_size)]
    summed = [sum(col) for col in zip(*(pack_marks(m, world_size) for m in ranks))]
    assert all(v < 2**53 for v in summed)  # exact in float64
    assert unpack_marks(summed, count, world_size) == [any(col) for col in zip(*ranks)]


def test_a_few_marks_cost_one_float() -> None:
    assert len(pack_marks([True] * 30, 2)) == 1  # base 3: 33 marks per float at two ranks
    assert pack_marks([], 2) == [] and unpack_marks([], 0, 2) == []
    with pytest.raises(ConfigError):
        unpack_marks([0.0], 100, 2)


