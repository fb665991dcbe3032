"""Failure and scaling policies: inputs in, a decision out (pure).

The driver's controller carries decisions out; nothing here touches actors.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence, Set
from dataclasses import dataclass

from zero_ray.errors import (
    CollectiveError,
    ConfigError,
    ControlError,
    NonFiniteError,
    OwnerError,
    OwnerLostError,
    ResourceError,
    StateCorruptError,
    StopRequested,
)

# Errors that refuse a call having changed nothing on any owner: the caller's to handle.
_REFUSALS = (NonFiniteError, ResourceError, ConfigError, StopRequested)


# StrEnums: a RecoveryReport's decision and source print, compare and serialise as their values
# ("restore", "peer"), as the strings they replaced did.
class Action(enum.StrEnum):
    REFORM = "reform"  # abort the survivors' collectives, re-form the group, continue
    RESTORE = "restore"  # rebuild the pool, restore the partitions from a source, replay
    RETRY = "retry"  # restore again from the same source, with what is left (no new owners)
    FALLBACK = "fallback"  # restore from the next source instead
    FAIL = "fail"  # stop: the run cannot continue consistently


class Source(enum.StrEnum):
    """Where lost (or untrustworthy) partitions come back from."""

    REPLICA = "replica"  # shard groups: a surviving group's live state (every group holds a full copy)
    PEER = "peer"  # the in-memory copies every rank keeps of its own and one peer's shard
    CHECKPOINT = "checkpoint"  # the last committed checkpoint


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str
    source: Source | None = None
    backoff_s: float = 0.0  # wait this long before acting (a flapping node gets time to settle)


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """A step that failed on live ranks before any weight changed is retried after the group is
    re-formed. A lost rank, or an update that was cut short, needs a restore source (peer copies
    first: no storage round trip; then the last checkpoint). ``max_failures`` failures are
    survived in one run, the next one fails it; ``backoff_s`` grows linearly with each one."""

    max_failures: int = 3
    backoff_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_failures < 0 or self.backoff_s < 0:
            raise ConfigError(f"{self.max_failures=} and {self.backoff_s=} must be >= 0")

    def sources(self, *, replica: bool, peer: bool, checkpoint: bool) -> list[Source]:
        """The restore sources to try, best first: a surviving shard group's live state
        (``replica``: the topology has replicas and a whole group survived; nothing to read and
        no step lost), then peer snapshots, then the last committed checkpoint."""
        return [s for s, ok in ((Source.REPLICA, replica), (Source.PEER, peer), (Source.CHECKPOINT, checkpoint)) if ok]

    def after_step_failure(self, *, lost_ranks: Set[int], failures_so_far: int,
                           sources: Sequence[Source] = ()) -> Decision:
        backoff = self.backoff_s * max(0, failures_so_far - 1)
        if failures_so_far > self.max_failures:
            return Decision(action=Action.FAIL, reason=f"{failures_so_far} failures exceed {self.max_failures=}")
        if lost_ranks:
            if sources:
                return Decision(action=Action.RESTORE, source=sources[0], backoff_s=backoff,
                                reason=f"ranks {sorted(lost_ranks)} were lost: restore their partitions from "
                                       f"{sources[0].value} and replay")
            return Decision(action=Action.FAIL, reason=f"ranks {sorted(lost_ranks)} were lost and their partitions "
                                                       "cannot be restored without a checkpoint or peer copies")
        return Decision(action=Action.REFORM, backoff_s=backoff,
                        reason="all ranks alive: abort, re-form the group and continue")

    def after_restore_failure(self, *, source: Source, lost: Set[int], survivors: int, attempt: int,
                              failures_so_far: int, sources_left: Sequence[Source] = ()) -> Decision:
        """A restore from ``source`` broke because owners were lost or got stuck in it (``lost``:
        those now gone). Try again from what is left, without starting replacements (that would
        double the time to the next step; the run grows back once it trains), while failures
        allow; a restore that could not read its source falls back to the next one."""
        if not survivors:
            return Decision(action=Action.FAIL, reason="every owner was lost while restoring")
        if failures_so_far > self.max_failures or attempt > self.max_failures:
            return Decision(action=Action.FAIL, reason=f"restoring from {source.value} failed {attempt} times "
                                                       f"({failures_so_far} failures, {self.max_failures=})")
        if lost:
            return Decision(action=Action.RETRY, source=source,
                            reason=f"ranks {sorted(lost)} were lost while restoring from {source.value}: restore "
                                   f"again with the {survivors} owners left")
        if sources_left:
            return self.after_source_failure(source=source, sources_left=sources_left, error="no owner was lost")
        return Decision(action=Action.RETRY, source=source,
                        reason=f"restoring from {source.value} was interrupted: try again")

    def after_source_failure(self, *, source: Source, sources_left: Sequence[Source], error: str) -> Decision:
        """``source`` cannot be read (peer copies incomplete, a checkpoint unreadable)."""
        if sources_left:
            return Decision(action=Action.FALLBACK, source=sources_left[0],
                            reason=f"{source.value} cannot restore the run ({error}): fall back to "
                                   f"{sources_left[0].value}")
        return Decision(action=Action.FAIL, reason=f"{source.value} cannot restore the run ({error}) and no other "
                                                   "source is left")

    def after_reform(self, *, consistent: bool, sources: Sequence[Source] = ()) -> Decision:
        if consistent:
            return Decision(action=Action.REFORM, reason="no rank had started its update: the state is intact")
        if sources:
            return Decision(action=Action.RESTORE, source=sources[0],
                            reason=f"a rank had started updating weights: restore from {sources[0].value} and replay")
        return Decision(action=Action.FAIL, reason="a rank had started updating weights: the partitions may disagree")

    def distrusted(self, error: BaseException) -> dict[int, str]:
        """Owners that answer but whose partition is not to be used, by rank with why: one whose
        optimizer state on disk failed its checksum (``StateCorruptError``). They are treated as
        lost: ended, and their partitions restored from a copy held elsewhere."""
        failure = getattr(error, "failure", None)
        if isinstance(error, StateCorruptError) and failure is not None and failure.rank is not None:
            return {failure.rank: "its optimizer state on disk failed a checksum"}
        return {}

    def needs_recovery(self, error: BaseException, *, collective: bool) -> bool:
        """Whether a call's failure is one to recover from (find the lost, abort, re-form or
        restore). A refusal (a non-finite step under "raise", no room, a bad setting, a stop)
        changed nothing. A call that runs collectives on the owners (a step, an evaluation, a
        resize) may have left any of them mid-collective whatever failed; one that does not (a
        save's snapshot, a report, registering data) needs recovery only when an owner failed or
        stopped answering, not when, say, its storage refused a write."""
        if isinstance(error, _REFUSALS):
            return False
        if collective:
            return True
        return isinstance(error, (OwnerError, CollectiveError, ControlError))

    def after_restore(self, *, resume_step: int, missing: Sequence[int], keep: int) -> Decision:
        """The state was restored at ``resume_step``: replay the kept batches up to where the
        user's calls had got, or fail when some of them are no longer kept (``missing``, 0-based
        step indices; ``keep`` is ``elastic.max_replay_steps``)."""
        if missing:
            return Decision(action=Action.FAIL,
                            reason=f"the restored state is at step {resume_step} but the batches of steps "
                                   f"{missing[0] + 1}..{missing[-1] + 1} are no longer kept (elastic.max_replay_steps="
                                   f"{keep}); resume with from_checkpoint")
        return Decision(action=Action.RESTORE, reason=f"restored at step {resume_step}: replay the kept batches")

    def retry_reformed(self, error: BaseException) -> bool:
        """After a re-form (no rank lost, no weight changed): whether the driver runs the failed
        step again itself. A broken or timed-out collective, or an owner that stopped answering and
        is back, says nothing about the step: run it again (``max_failures`` bounds the retries).
        An error the step raised itself (the loss function, the batch, a setting) would come back:
        it goes to the caller."""
        return isinstance(error, (CollectiveError, OwnerLostError))


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """How many owners to run. The run has a desired size: the one it started with, or the one
    the last ``resize`` asked for. After a loss it continues with the survivors alone
    (``continue_on_survivors``: replacements start meanwhile and join once up), or else with the
    survivors plus as many replacements as the cluster has room for, up to the desired size;
    never with fewer than ``min_world_size``. It grows back to the desired size when room
    appears, never beyond.
    ``resize`` may ask for any size in ``[min_world_size, max_world_size]`` (no upper bound
    when ``max_world_size`` is None)."""

    min_world_size: int = 1
    max_world_size: int | None = None
    continue_on_survivors: bool = False

    def __post_init__(self) -> None:
        if self.min_world_size < 1:
            raise ConfigError(f"min_world_size={self.min_world_size} must be at least 1")
        if self.max_world_size is not None and self.max_world_size < self.min_world_size:
            raise ConfigError(f"max_world_size={self.max_world_size} is below min_world_size={self.min_world_size}")

    def check_resize(self, world_size: int) -> None:
        """A size ``resize`` may ask for, or ConfigError naming the bound."""
        if world_size < self.min_world_size:
            raise ConfigError(f"resize to {world_size} owners is below elastic.min_world_size={self.min_world_size}")
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ConfigError(f"resize to {world_size} owners is above elastic.max_world_size={self.max_world_size}; "
                              "raise max_world_size to grow further")

    def after_loss(self, *, survivors: int, free_slots: int, desired: int, multiple: int = 1) -> int | None:
        """The size to restore to, rounded down to a ``multiple`` (a shard group's size: the groups
        stay whole, surplus survivors leave): the survivors alone when continuing on them (at least
        ``min_world_size`` of them, and two: a lone survivor would hold the only copy of every
        partition until its replacements joined), else survivors plus as many new owners as fit,
        up to ``desired``; None when even that is below ``min_world_size`` or is no group."""
        multiple = max(1, multiple)
        kept = survivors - survivors % multiple
        if self.continue_on_survivors and kept >= max(2, self.min_world_size):
            return kept
        target = min(desired, survivors + max(0, free_slots))
        target -= target % max(1, multiple)
        return target if target >= max(self.min_world_size, 1) else None

    def without_room(self, *, survivors: int, replacements: bool) -> bool:
        """No room for the replacements after all (another job took the freed slots): whether to
        carry on with the survivors alone (True) or give this source up (False: already alone)."""
        return replacements and survivors >= self.min_world_size

    def leavers(self, *, survivors: Sequence[int], target: int) -> list[int]:
        """Who leaves when fewer owners than survive are to go on (shard groups keep a multiple
        of the group size): the highest ranks, so that the ranks kept stay 0..target-1."""
        return sorted(survivors)[target:] if target < len(survivors) else []

    def grow_to(self, *, current: int, free_slots: int, desired: int) -> int | None:
        """A larger size when the cluster has room again (a replaced node), else None: never
        beyond ``desired``."""
        target = min(desired, current + max(0, free_slots))
        return target if target > current else None
