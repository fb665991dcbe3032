"""The failure policy decides; it touches nothing (pure)."""

from __future__ import annotations

from zero_ray.core.policy import Action, FailurePolicy


def test_a_lost_rank_fails_the_run_without_a_restore_source() -> None:
    d = FailurePolicy().after_step_failure(lost_ranks={2}, failures_so_far=1)
    assert d.action is Action.FAIL and "[2]" in d.reason


def test_a_failure_on_live_ranks_is_retried_until_max_failures() -> None:
    policy = FailurePolicy(max_failures=2)
    assert policy.after_step_failure(lost_ranks=set(), failures_so_far=1).action is Action.REFORM
    assert policy.after_step_failure(lost_ranks=set(), failures_so_far=2).action is Action.REFORM
    d = policy.after_step_failure(lost_ranks=set(), failures_so_far=3)
    assert d.action is Action.FAIL and "max_failures=2" in d.reason


def test_an_update_in_progress_means_the_state_cannot_be_trusted() -> None:
    assert FailurePolicy().after_reform(consistent=True).action is Action.REFORM
    assert FailurePolicy().after_reform(consistent=False).action is Action.FAIL


def test_a_lost_rank_is_restored_from_the_first_source_available() -> None:
    from zero_ray.core.policy import Source

    d = FailurePolicy().after_step_failure(lost_ranks={1}, failures_so_far=1, sources=[Source.PEER, Source.CHECKPOINT])
    assert d.action is Action.RESTORE and d.source is Source.PEER
    d = FailurePolicy().after_reform(consistent=False, sources=[Source.CHECKPOINT])
    assert d.action is Action.RESTORE and d.source is Source.CHECKPOINT
    d = FailurePolicy(max_failures=2).after_step_failure(lost_ranks={1}, failures_so_far=3, sources=[Source.PEER])
    assert d.action is Action.FAIL


def test_backoff_grows_with_each_failure() -> None:
    policy = FailurePolicy(max_failures=5, backoff_s=0.5)
    assert [policy.after_step_failure(lost_ranks=set(), failures_so_far=n).backoff_s for n in (1, 2, 3)] == [0, 0.5, 1.0]


def test_scaling_policy_bounds_the_size() -> None:
    from zero_ray.core.policy import ScalingPolicy

    p = ScalingPolicy(min_world_size=2)
    assert p.after_loss(survivors=3, free_slots=0, initial=4) == 3
    assert p.after_loss(survivors=3, free_slots=5, initial=4) == 4  # replaced, up to the starting size
    assert p.after_loss(survivors=1, free_slots=0, initial=4) is None
    assert p.grow_to(current=3, free_slots=1, initial=4) == 4
    assert p.grow_to(current=4, free_slots=3, initial=4) is None
    assert ScalingPolicy(max_world_size=6).grow_to(current=4, free_slots=3, initial=4) == 6
