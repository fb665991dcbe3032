"""The failure policy decides; it touches nothing (pure)."""

from __future__ import annotations

from zero_ray.core.policy import Action, FailurePolicy


def test_a_lost_rank_fails_the_run_without_a_restore_source() -> None:
    d = FailurePolicy().after_step_failure(lost_ranks={2}, failures_so_far=1)
    assert d.action is Action.FAIL and "[2]" in d.reason


def test_a_failure_on_live_ranks_is_retried_until_max_failures() -> None:
    policy = FailurePolicy(max_failures=2)
    assert policy.after_step_failure(lost_ranks=set(), failures_so_far=1).action is Action.REFORM
    d = policy.after_step_failure(lost_ranks=set(), failures_so_far=2)
    assert d.action is Action.FAIL and "max_failures=2" in d.reason


def test_an_update_in_progress_means_the_state_cannot_be_trusted() -> None:
    assert FailurePolicy().after_reform(consistent=True).action is Action.REFORM
    assert FailurePolicy().after_reform(consistent=False).action is Action.FAIL
