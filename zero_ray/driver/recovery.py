"""Recovery: carrying out the failure policy's decision after a failed step.

The FailurePolicy and ScalingPolicy (``core/policy.py``) decide; this controller acts: it ends
lost owners, aborts the survivors' collectives, and then either re-forms the group (nothing
lost, nothing updated), or rebuilds the pool at the size the scaling policy allows and restores
every partition — from the peers' in-memory snapshots when they hold a complete, common step,
else from the last committed checkpoint — reporting the step the trainer must replay from.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from zero_ray.checkpoint import store
from zero_ray.core.policy import Action, Decision, FailurePolicy, ScalingPolicy, Source
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CheckpointError, ResourceError, ZeroRayError

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    REFORMED = "reformed"  # the step was not taken anywhere: the caller may retry it
    RESTORED = "restored"  # the state is at ``RecoveryReport.resume_step``: replay from there
    FAILED = "failed"


@dataclass(kw_only=True)
class RecoveryReport:
    """What happened: who was lost, what was decided, how long each part took."""

    failed_step: int  # 0-based index of the step that failed
    error: str
    lost: dict[int, str]
    decision: str
    reason: str
    source: str | None = None
    world_size_before: int = 0
    world_size_after: int = 0
    resume_step: int | None = None  # steps completed in the restored state
    replayed_steps: int = 0
    detect_s: float = 0.0  # from the lost rank's last heartbeat (or the step's start) to the error
    abort_s: float = 0.0  # ending lost owners and aborting the survivors' collectives
    restore_s: float = 0.0  # rebuilding the pool and restoring the partitions
    replay_s: float = 0.0
    outcome: Outcome = Outcome.FAILED
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lost = f"lost ranks {sorted(self.lost)}" if self.lost else "no rank lost"
        return (f"step {self.failed_step + 1} failed ({lost}): {self.decision}"
                + (f" from {self.source}" if self.source else "")
                + f", {self.world_size_before} -> {self.world_size_after} owners, replayed {self.replayed_steps} "
                  f"steps; detect {self.detect_s:.2f}s, abort {self.abort_s:.2f}s, restore {self.restore_s:.2f}s"
                + (f", replay {self.replay_s:.2f}s" if self.replay_s >= 0 else ", replaying"))


class RecoveryController:
    """Acts on failure decisions for one run."""

    def __init__(self, pool: OwnerPool, *, failure: FailurePolicy, scaling: ScalingPolicy, initial_world_size: int,
                 peer_redundancy: bool, checkpoint_root: Any, probe_timeout_s: float = 2.0) -> None:
        self._pool = pool
        self._failure = failure
        self._scaling = scaling
        self._initial = initial_world_size
        self._peer = peer_redundancy
        self._checkpoint_root = checkpoint_root  # () -> str | None: the root of the last committed save
        self._probe_timeout_s = probe_timeout_s
        self.failures = 0

    def _sources(self) -> list[Source]:
        out = [Source.PEER] if self._peer else []
        root = self._checkpoint_root()
        if root is not None and store.committed(root):
            out.append(Source.CHECKPOINT)
        return out

    def recover(self, err: ZeroRayError, *, failed_step: int, step_started: float,
                load_checkpoint: Any) -> RecoveryReport:
        """Decide and act after step ``failed_step`` raised ``err``."""
        t0 = time.time()
        self.failures += 1
        pool = self._pool
        lost = pool.find_lost(timeout_s=self._probe_timeout_s)
        beats = {h.rank: h.last_beat for h in pool.health.snapshot()} if pool.health else {}
        since = min((beats.get(r) or step_started for r in lost), default=step_started)
        sources = self._sources()
        decision = self._failure.after_step_failure(lost_ranks=set(lost), failures_so_far=self.failures,
                                                    sources=sources)
        report = RecoveryReport(failed_step=failed_step, error=str(err).splitlines()[0], lost=dict(lost),
                                decision=decision.action.value, reason=decision.reason,
                                world_size_before=pool.world_size, detect_s=max(0.0, t0 - since))
        log.warning("step %d failed (%s); %s: %s", failed_step + 1, report.error, decision.action.value,
                    decision.reason)
        if decision.backoff_s:
            time.sleep(decision.backoff_s)  # policy back-off, not synchronisation
        if lost:
            pool.kill(sorted(lost))  # a frozen process holds its sockets open: end it first
        pool.abort(f"step {failed_step + 1} failed: {err}")
        report.abort_s = time.time() - t0
        if decision.action is Action.REFORM:
            try:
                consistent = pool.reform()
            except ZeroRayError as reform_err:
                log.error("re-forming the group failed: %s", reform_err)
                report.notes.append(f"re-forming failed: {reform_err}")
                consistent = False
                lost = pool.find_lost(timeout_s=self._probe_timeout_s)  # a rank may have died meanwhile
                if lost:
                    report.lost = dict(lost)
                    pool.kill(sorted(lost))
            decision = self._failure.after_reform(consistent=consistent, sources=sources)
            report.decision, report.reason = decision.action.value, decision.reason
            if decision.action is Action.REFORM:
                report.outcome, report.world_size_after = Outcome.REFORMED, pool.world_size
                return report
        if decision.action is Action.RESTORE:
            self._restore(decision, report, lost=set(lost), committed_step=failed_step - 1,
                          sources=sources, load_checkpoint=load_checkpoint)
        if report.outcome is not Outcome.RESTORED:
            report.decision = Action.FAIL.value
        return report

    def _restore(self, decision: Decision, report: RecoveryReport, *, lost: set[int], committed_step: int,
                 sources: list[Source], load_checkpoint: Any) -> None:
        pool = self._pool
        t0 = time.time()
        survivors = [r for r in range(pool.world_size) if r not in lost]
        target = self._scaling.after_loss(survivors=len(survivors), free_slots=pool.free_slots(),
                                          initial=self._initial)
        if target is None:
            report.reason = (f"only {len(survivors)} owners survive, below min_world_size="
                             f"{self._scaling.min_world_size}")
            return
        generation = pool.generation
        for source in sources[sources.index(decision.source):] if decision.source in sources else []:
            try:
                try:
                    report.resume_step = self._restore_from(source, survivors, target, committed_step, load_checkpoint)
                except ResourceError as err:  # no room for replacements after all: carry on without them
                    report.notes.append(f"no replacements ({err}); continuing with {len(survivors)} owners")
                    target = len(survivors)
                    if target < self._scaling.min_world_size:
                        raise
                    report.resume_step = self._restore_from(source, survivors, target, committed_step, load_checkpoint)
            except (ZeroRayError, ResourceError) as err:
                report.notes.append(f"restoring from {source.value} failed: {err}")
                log.error("restoring from %s failed: %s", source.value, err)
                if pool.generation != generation:  # the pool was rebuilt: everyone in it is a survivor
                    survivors, generation = list(range(pool.world_size)), pool.generation
                continue
            report.source, report.outcome = source.value, Outcome.RESTORED
            report.world_size_after = pool.world_size
            report.restore_s = time.time() - t0
            return

    def _restore_from(self, source: Source, survivors: list[int], target: int, committed_step: int,
                      load_checkpoint: Any) -> int:
        if source is Source.PEER:
            return self._restore_from_peers(survivors, target, committed_step)
        self._pool.rebuild(survivors, target, restore=lambda position: None)
        return int(load_checkpoint())

    def _restore_from_peers(self, survivors: list[int], target: int, committed_step: int) -> int:
        """Rebuild from the snapshots the survivors hold; returns the steps completed in them."""
        pool = self._pool
        held = pool.snapshot_info(survivors, committed_step)
        taken = {(info["step"], info["world_size"]) for infos in held.values() for info in infos.values()}
        if len(taken) != 1:
            raise CheckpointError(f"peer snapshots disagree on (step, world size): {sorted(taken)}, or none were taken")
        step, old_world = taken.pop()  # the layout they were taken in (a resize may have been cut short)
        holder: dict[int, int] = {}
        for position, old in enumerate(survivors):
            for rank in held[old]:
                holder.setdefault(rank, position)
        missing = sorted(set(range(old_world)) - set(holder))
        if missing:
            raise CheckpointError(f"no surviving peer holds a snapshot of ranks {missing} (their backups were lost "
                                  "too); restore from a checkpoint instead")
        scalars = next(iter(held[survivors[0]].values()))["scalars"]
        plan = {"buckets": scalars["buckets"], "whole": scalars["whole"], "kinds": scalars["kinds"],
                "old_world": old_world, "holders": [holder[r] for r in range(old_world)], "scalars": scalars}
        pool.rebuild(survivors, target, restore=lambda position: plan)
        return step + 1
