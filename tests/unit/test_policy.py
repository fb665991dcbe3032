"""The failure policy decides; it touches nothing (pure)."""

from __future__ import annotations

import pytest

from zero_ray.core.elastic_policy import Action, FailurePolicy
from zero_ray.errors import CollectiveError, CollectiveTimeout, ConfigError, OwnerError, OwnerLostError, ZeroRayError


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
    from zero_ray.core.elastic_policy import Source

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
    from zero_ray.core.elastic_policy import ScalingPolicy

    p = ScalingPolicy(min_world_size=2)
    assert p.after_loss(survivors=3, free_slots=0, desired=4) == 3
    assert p.after_loss(survivors=3, free_slots=5, desired=4) == 4  # replaced, up to the desired size
    assert p.after_loss(survivors=1, free_slots=0, desired=4) is None
    assert p.grow_to(current=3, free_slots=1, desired=4) == 4
    assert p.grow_to(current=4, free_slots=3, desired=4) is None


def test_continuing_on_the_survivors_restores_onto_them_unless_one_would_be_left_alone() -> None:
    from zero_ray.core.elastic_policy import ScalingPolicy

    p = ScalingPolicy(continue_on_survivors=True)
    assert p.after_loss(survivors=2, free_slots=4, desired=3) == 2  # replacements join later (grow_to)
    assert p.grow_to(current=2, free_slots=4, desired=3) == 3
    assert p.after_loss(survivors=1, free_slots=4, desired=3) == 3  # a lone survivor holds the only copies: wait
    assert p.after_loss(survivors=1, free_slots=0, desired=3) == 1  # no room: carry on alone
    strict = ScalingPolicy(continue_on_survivors=True, min_world_size=3)
    assert strict.after_loss(survivors=2, free_slots=1, desired=3) == 3  # never below min_world_size
    assert strict.after_loss(survivors=2, free_slots=0, desired=3) is None
    # Shard groups of 2: the survivors of whole groups go on; a broken group's survivor leaves.
    assert p.after_loss(survivors=3, free_slots=0, desired=4, multiple=2) == 2
    assert p.after_loss(survivors=4, free_slots=2, desired=6, multiple=2) == 4
    assert p.after_loss(survivors=1, free_slots=3, desired=4, multiple=2) == 4  # no whole group left: wait
    assert p.after_loss(survivors=1, free_slots=2, desired=4, multiple=2) == 2


def test_room_in_the_cluster_never_grows_a_run_beyond_its_desired_size() -> None:
    from zero_ray.core.elastic_policy import ScalingPolicy

    p = ScalingPolicy(max_world_size=6)
    assert p.grow_to(current=3, free_slots=3, desired=3) is None  # started at 3: stays at 3 before any loss
    assert p.after_loss(survivors=2, free_slots=4, desired=3) == 3  # a lost owner is replaced, not more
    assert p.grow_to(current=4, free_slots=2, desired=6) == 6  # after resize(6) shrank by a loss: back to 6
    p.check_resize(6)
    with pytest.raises(ConfigError, match="above elastic.max_world_size=6"):
        p.check_resize(7)
    with pytest.raises(ConfigError, match="below elastic.min_world_size=2"):
        ScalingPolicy(min_world_size=2).check_resize(1)


def test_a_restore_broken_by_a_loss_is_retried_with_what_is_left() -> None:
    from zero_ray.core.elastic_policy import Source

    policy = FailurePolicy(max_failures=3)
    d = policy.after_restore_failure(source=Source.PEER, lost={2}, survivors=2, attempt=1, failures_so_far=2)
    assert d.action is Action.RETRY and d.source is Source.PEER and "[2]" in d.reason
    d = policy.after_restore_failure(source=Source.PEER, lost={2}, survivors=2, attempt=4, failures_so_far=2)
    assert d.action is Action.FAIL and "4 times" in d.reason
    d = policy.after_restore_failure(source=Source.PEER, lost={0, 1}, survivors=0, attempt=1, failures_so_far=1)
    assert d.action is Action.FAIL and "every owner" in d.reason
    d = policy.after_restore_failure(source=Source.PEER, lost=set(), survivors=2, attempt=1, failures_so_far=1,
                                     sources_left=[Source.CHECKPOINT])
    assert d.action is Action.FALLBACK and d.source is Source.CHECKPOINT


def test_an_unreadable_source_falls_back_to_the_next() -> None:
    from zero_ray.core.elastic_policy import Source

    d = FailurePolicy().after_source_failure(source=Source.PEER, sources_left=[Source.CHECKPOINT], error="gone")
    assert d.action is Action.FALLBACK and d.source is Source.CHECKPOINT
    d = FailurePolicy().after_source_failure(source=Source.CHECKPOINT, sources_left=[], error="corrupt")
    assert d.action is Action.FAIL and "corrupt" in d.reason


def test_without_room_the_run_carries_on_with_the_survivors_once() -> None:
    from zero_ray.core.elastic_policy import ScalingPolicy

    p = ScalingPolicy(min_world_size=2)
    assert p.without_room(survivors=2, replacements=True)
    assert not p.without_room(survivors=2, replacements=False)  # already alone: this source is given up
    assert not p.without_room(survivors=1, replacements=True)


@pytest.mark.parametrize(("error", "retry"), [
    (CollectiveError("the all-gather of bucket 3 broke"), True),
    (CollectiveTimeout("reduce-scatter did not end within 30s"), True),
    (OwnerLostError("rank 1 stopped answering", rank=1), True),
    (OwnerError("rank 1 failed in step: RuntimeError: bad batch", rank=1), False),
    (ConfigError("global batch of 3 samples is smaller than world_size"), False),
    (ZeroRayError("this batch cannot be unpickled on an owner"), False),
])
def test_a_reformed_step_is_run_again_only_when_the_failure_says_nothing_about_the_step(
        error: ZeroRayError, retry: bool) -> None:
    assert FailurePolicy().retry_reformed(error) is retry


def test_only_failures_of_owners_need_recovery_outside_collectives() -> None:
    from zero_ray.errors import CheckpointError, ControlError, NonFiniteError, ResourceError, StopRequested

    p = FailurePolicy()
    for refusal in (NonFiniteError("x"), ResourceError("x"), ConfigError("x"), StopRequested("x")):
        assert not p.needs_recovery(refusal, collective=True)
        assert not p.needs_recovery(refusal, collective=False)
    # A step may have left owners mid-collective whatever failed; a save refused by its storage did not.
    assert p.needs_recovery(CheckpointError("disk full"), collective=True)
    assert not p.needs_recovery(CheckpointError("disk full"), collective=False)
    for lost in (OwnerLostError("gone", rank=1), OwnerError("x", rank=0), CollectiveError("x"), ControlError("x")):
        assert p.needs_recovery(lost, collective=False)


def test_a_restore_fails_the_run_when_the_replay_is_no_longer_kept() -> None:
    p = FailurePolicy()
    ok = p.after_restore(resume_step=4, missing=[], keep=8)
    assert ok.action is Action.RESTORE
    gone = p.after_restore(resume_step=2, missing=[2, 3, 4], keep=2)
    assert gone.action is Action.FAIL
    assert "steps 3..5 are no longer kept (elastic.max_replay_steps=2)" in gone.reason


def test_the_highest_ranks_leave_when_fewer_owners_go_on() -> None:
    from zero_ray.core.elastic_policy import ScalingPolicy

    s = ScalingPolicy()
    assert s.leavers(survivors=[0, 2, 3, 5], target=2) == [3, 5]
    assert s.leavers(survivors=[0, 1], target=2) == []


def test_an_owner_whose_state_failed_its_checksum_is_treated_as_lost() -> None:
    from zero_ray.errors import FailureDetail, StateCorruptError

    remote = FailureDetail(type="StateCorruptError", message="rank 1: ... fail their checksum", rank=1).error("rank 1")
    assert isinstance(remote, StateCorruptError)  # rebuilt on the driver as its own type, with its rank
    assert FailurePolicy().distrusted(remote) == {1: "its optimizer state on disk failed a checksum"}
    other = FailureDetail(type="CollectiveError", message="peer reset", rank=0).error("rank 0")
    assert FailurePolicy().distrusted(other) == {}
    assert FailurePolicy().distrusted(StateCorruptError("raised here, no rank known")) == {}
