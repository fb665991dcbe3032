"""Recovery: carrying out the failure policy's decision after a failed step or operation.

The FailurePolicy and ScalingPolicy (``core/elastic_policy.py``) decide; this controller acts: it ends
lost owners (their slots go back to the cluster), aborts the survivors' collectives, and then
either re-forms the group (nothing lost, nothing updated), or rebuilds the pool at the size the
scaling policy allows (the survivors alone, replacements starting meanwhile to join once up; or
replacements in freed slots, waited for, up to the size before the loss) and
restores every partition (from the peers' in-memory snapshots when they hold a complete, common
step, else from the last committed checkpoint), reporting the step to replay from. An owner
lost or stuck while that restore runs is ended too and the restore tried again from what is
left, without replacements (the run grows back later), as long as ``max_failures`` allows.

The recent global batches it checks the replay against are kept by ``batch_staging.Replay``
(indices only, for ``fit``), where the controller puts each step's batch as it sends it.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zero_ray.checkpoint import store
from zero_ray.checkpoint.location import open_location
from zero_ray.core.stall_diagnosis import diagnose, where
from zero_ray.core.elastic_policy import Action, Decision, FailurePolicy, ScalingPolicy, Source
from zero_ray.core.placement import group_survivors
from zero_ray.core.restore_plan import PeerRestore
from zero_ray.core.topology import Topology
from zero_ray.driver.batch_staging import Replay
from zero_ray.driver.pool import OwnerPool
from zero_ray.driver.replica_restore import replica_mesh, restore_from_replica
from zero_ray.errors import (
    CallTimeout,
    CheckpointError,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    OwnerError,
    ResourceError,
    ZeroRayError,
)

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    REFORMED = "reformed"  # the step was not taken anywhere: the caller may retry it
    RESTORED = "restored"  # the state is at ``RecoveryReport.resume_step``: replay from there
    FAILED = "failed"

    @property
    def decision(self) -> Action:
        """The policies' final decision that led here."""
        return {Outcome.REFORMED: Action.REFORM, Outcome.RESTORED: Action.RESTORE, Outcome.FAILED: Action.FAIL}[self]


@dataclass(frozen=True, kw_only=True)
class Restored:
    """A restore that succeeded: from which source, the steps completed in the restored state,
    the pool's size after it and how long it took."""

    source: Source
    resume_step: int
    world_size: int
    seconds: float

    def __post_init__(self) -> None:
        if self.resume_step < 0 or self.world_size < 1:
            raise ConfigError(f"a restore to step {self.resume_step} at {self.world_size} owners: the step must be "
                              ">= 0 and the pool must keep an owner")


@dataclass(frozen=True, kw_only=True)
class NotRestored:
    """No source could restore the run; ``reason``: the policies' last word (None: the
    decision's own reason stands)."""

    reason: str | None = None


@dataclass(kw_only=True)
class RecoveryReport:
    """What happened: who was lost, what was decided, how long each part took. ``decision``
    (REFORM, RESTORE or FAIL: the outcome's) and ``source`` (where the state came back from,
    None when nothing was restored) are set once, when the recovery is over; they print and
    compare as their values ("restore", "peer"). Only ``replay_s`` changes later: it is measured
    once the replay the restore asked for is done."""

    failed_step: int  # 0-based index of the step that failed, or at which the failed call ran
    call: str = ""  # the call that found the failure ("step 3", "save_checkpoint", ...)
    error: str
    lost: dict[int, str]
    decision: Action
    reason: str
    source: Source | None = None
    world_size_before: int = 0
    world_size_after: int = 0
    resume_step: int | None = None  # steps completed in the restored state
    replayed_steps: int = 0
    detect_s: float = 0.0  # from the lost rank's last heartbeat (or the step's start) to the error
    abort_s: float = 0.0  # ending lost owners and aborting the survivors' collectives
    restore_s: float = 0.0  # rebuilding the pool and restoring the partitions
    replay_s: float = 0.0
    outcome: Outcome = Outcome.FAILED
    retry: bool = False  # re-formed, and the policy runs the step again (not the caller)
    stall: str = ""  # a stalled call: every rank's flight record, and which one diverged
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lost = f"lost ranks {sorted(self.lost)}" if self.lost else "no rank lost"
        return (f"{self.call or f'step {self.failed_step + 1}'} failed ({lost}): {self.decision}"
                + (f" from {self.source}" if self.source else "")
                + f", {self.world_size_before} -> {self.world_size_after} owners, replayed {self.replayed_steps} "
                  f"steps; detect {self.detect_s:.2f}s, abort {self.abort_s:.2f}s, restore {self.restore_s:.2f}s"
                + (f", replay {self.replay_s:.2f}s" if self.replay_s >= 0 else ", replaying")
                + (f"; stalled: {self.stall.splitlines()[0]}" if self.stall else ""))


def failed_error(err: ZeroRayError, report: RecoveryReport) -> ZeroRayError | None:
    """``err`` again, saying why the run ended (its own message first, so it still reads as what
    went wrong); None for an error type that cannot be rebuilt from a message."""
    text = (f"{err}" + (f"\n\nWhere every rank was: {report.stall}" if report.stall else "")
            + f"\n\nThe run failed at step {report.failed_step + 1}: {report.reason}"
            + (f" ({'; '.join(report.notes)})" if report.notes else ""))
    try:
        if isinstance(err, OwnerError):
            return type(err)(text, rank=err.rank)
        return type(err)(text)
    except TypeError:
        return None


class RecoveryController:
    """Acts on failure decisions for one run. ``desired`` is the size the run should have: where
    it started, or what the last ``resize`` asked for; a run shrunk by a loss grows back to it,
    never beyond."""

    def __init__(self, pool: OwnerPool, *, failure: FailurePolicy, scaling: ScalingPolicy, desired: int,
                 peer_redundancy: bool, checkpoint_root: Callable[[], str | None],
                 grow_back: bool = True, grow_check_s: float = 5.0, probe_timeout_s: float = 2.0,
                 topology: Topology | None = None) -> None:
        self._pool = pool
        self.failure = failure
        self.scaling = scaling
        self.desired = desired
        self._peer = peer_redundancy
        self._checkpoint_root = checkpoint_root  # the root of the last committed save, or None
        self._probe_timeout_s = probe_timeout_s
        self._topology = topology or Topology()
        self._grow_back, self._grow_check_s = grow_back, grow_check_s
        self._last_grow_check = 0.0  # monotonic: when the cluster's free room was last asked
        self.failures = 0
        self.last_stall = ""  # the last stalled call's diagnosis

    def _sources(self, lost: set[int] | frozenset[int] = frozenset()) -> list[Source]:
        checkpoint = False
        root = self._checkpoint_root()
        if root is not None:
            try:
                storage, path = open_location(root)
                checkpoint = store.committed(path, storage=storage)
            except CheckpointError as err:  # e.g. the object store is unreachable: not a source now
                log.warning("the checkpoint root %s cannot be used for recovery: %s", root, err)
        replica = bool(lost) and replica_mesh(self._pool, self._topology, lost) is not None
        return self.failure.sources(replica=replica, peer=self._peer, checkpoint=checkpoint)

    def _stall(self, err: ZeroRayError) -> dict[int, str] | None:
        """After a call or collective timed out with every owner alive: who the others wait for,
        from every rank's flight record (``core/stall_diagnosis.diagnose``), by rank with where it is;
        None when no rank diverged (a slow step, not a stuck one)."""
        if not isinstance(err, (CallTimeout, CollectiveTimeout)):
            return None
        flights, unreachable = self._pool.flights(timeout_s=self._probe_timeout_s)
        diagnosis = diagnose(flights, unreachable=unreachable)
        self.last_stall = diagnosis.text()
        log.error("a stalled call: %s", self.last_stall)
        if not diagnosis.stuck:
            return None
        by_rank = {f.rank: where(f) for f in flights}
        return {r: by_rank[r] for r in diagnosis.stuck}

    def _end(self, lost: dict[int, str], reason: str) -> None:
        """End the lost owners (a frozen process holds its sockets open; its slot is freed) and
        abort the survivors' collectives."""
        if lost:
            self._pool.kill(sorted(lost))
        self._pool.abort(reason, lost=sorted(lost))

    def recover(self, err: ZeroRayError, *, failed_step: int, step_started: float,
                load_checkpoint: Callable[[], int], replay: Replay, until: int, keep: int,
                call: str = "") -> RecoveryReport:
        """Decide and act after step ``failed_step`` (or ``call``, between steps) raised ``err``.
        A restore must leave ``replay``'s kept batches covering the steps up to index ``until``
        (at most ``keep`` of them: ``FailurePolicy.after_restore``), else the run fails."""
        t0 = time.time()
        self.failures += 1
        pool = self._pool
        lost = {**pool.find_lost(timeout_s=self._probe_timeout_s), **self.failure.distrusted(err)}
        stall = self._stall(err) if not lost else None
        if stall is not None:  # the rank the others wait for, and only it, is lost
            lost = {r: f"stuck ({where})" for r, where in stall.items()}
        beats = {h.rank: h.last_beat for h in pool.health.snapshot()} if pool.health else {}
        since = min((beats.get(r) or step_started for r in lost), default=step_started)
        sources = self._sources(set(lost))
        decision = self.failure.after_step_failure(lost_ranks=set(lost), failures_so_far=self.failures,
                                                    sources=sources)
        reported_lost, world_size_before, error = dict(lost), pool.world_size, str(err).splitlines()[0]
        log.warning("%s failed (%s); %s: %s", call or f"step {failed_step + 1}", error,
                    decision.action.value, decision.reason)
        if decision.backoff_s:
            time.sleep(decision.backoff_s)  # policy back-off, not synchronisation
        self._end(lost, f"step {failed_step + 1} failed: {err}")
        abort_s = time.time() - t0
        notes: list[str] = []
        outcome, reason, retry, restored = Outcome.FAILED, decision.reason, False, None
        if decision.action is Action.REFORM:
            try:
                consistent = pool.reform()
            except ZeroRayError as reform_err:
                log.error("re-forming the group failed: %s", reform_err)
                notes.append(f"re-forming failed: {reform_err}")
                consistent = False
                lost = pool.find_lost(timeout_s=self._probe_timeout_s)  # a rank may have died meanwhile
                if lost:
                    reported_lost = dict(lost)
                    self._end(lost, f"re-forming failed: {reform_err}")
            decision = self.failure.after_reform(consistent=consistent, sources=sources)
            reason = decision.reason
            if decision.action is Action.REFORM:
                outcome, retry = Outcome.REFORMED, self.failure.retry_reformed(err)
        if decision.action is Action.RESTORE:
            got = self._restore(decision, lost=set(lost), committed_step=failed_step - 1, sources=sources,
                                load_checkpoint=load_checkpoint, notes=notes)
            if isinstance(got, Restored):
                restored = got
                after = self.failure.after_restore(resume_step=got.resume_step,
                                                   missing=replay.missing(got.resume_step, until), keep=keep)
                if after.action is Action.FAIL:
                    reason = after.reason
                else:
                    outcome = Outcome.RESTORED
            elif got.reason is not None:
                reason = got.reason
        self._last_grow_check = time.monotonic()  # room is asked grow_check_s later, not on top of the replay
        resumed = outcome is Outcome.RESTORED
        return RecoveryReport(
            failed_step=failed_step, call=call, error=error, lost=reported_lost, decision=outcome.decision,
            reason=reason, source=restored.source if restored else None, world_size_before=world_size_before,
            world_size_after=restored.world_size if restored else pool.world_size if outcome is Outcome.REFORMED else 0,
            resume_step=restored.resume_step if restored else None,
            replayed_steps=until - restored.resume_step if resumed and restored else 0,
            detect_s=max(0.0, t0 - since), abort_s=abort_s, restore_s=restored.seconds if restored else 0.0,
            replay_s=-1.0 if resumed else 0.0,  # measured when the replay is done
            outcome=outcome, retry=retry, stall=self.last_stall if stall is not None else "", notes=notes)

    def _restore(self, decision: Decision, *, lost: set[int], committed_step: int, sources: list[Source],
                 load_checkpoint: Callable[[], int], notes: list[str]) -> Restored | NotRestored:
        """Restore from ``decision.source``; after each try the policies say what next (retry
        with what is left, carry on without replacements, fall back to the next source, give up).
        What went wrong on the way is added to ``notes``."""
        pool = self._pool
        t0 = time.time()
        survivors = [r for r in range(pool.world_size) if r not in lost]
        source = decision.source
        attempt, replacements = 0, True
        first = pool.generation  # a replica is live only in the pool the loss happened in
        while source is not None:
            left = sources[sources.index(source) + 1:] if source in sources else []
            # With shard groups every source restores whole groups (G a fixed int, or the lost mesh's).
            mesh = replica_mesh(pool, self._topology, lost) if pool.generation == first else None
            size = self._topology.shard_group_size
            multiple = size if isinstance(size, int) else (mesh.shard if mesh is not None else 1)
            multiple = math.lcm(multiple, pool.tensor_parallel)  # whole TP groups, as a resize takes
            target = self.scaling.after_loss(survivors=len(survivors), desired=self.desired,
                                              free_slots=pool.free_slots() if replacements else 0, multiple=multiple)
            if target is None:
                return NotRestored(reason=f"only {len(survivors)} owners survive, below min_world_size="
                                          f"{self.scaling.min_world_size}")
            generation = pool.generation
            try:
                if source is Source.REPLICA and pool.generation != first:
                    raise CheckpointError("the pool was rebuilt since the loss: the replicas' live state is gone")
                resume_step = self._restore_from(source, survivors, target, committed_step, load_checkpoint, lost=lost)
            except ResourceError as err:  # no room for the replacements after all
                notes.append(f"no replacements ({err})")
                if self.scaling.without_room(survivors=len(survivors), replacements=replacements):
                    replacements = False
                    continue
                decision = self.failure.after_source_failure(source=source, sources_left=left, error=str(err))
            except (OwnerError, CollectiveError) as err:  # an owner lost or stuck while restoring
                attempt += 1
                self.failures += 1
                if pool.generation != generation:  # the pool was rebuilt: everyone in it is a survivor
                    survivors = list(range(pool.world_size))
                again = pool.find_lost(timeout_s=self._probe_timeout_s)
                if isinstance(err, OwnerError) and err.rank is not None and err.rank < pool.world_size:
                    again.setdefault(err.rank, str(err).splitlines()[0])
                notes.append(f"restoring from {source.value} failed (lost {sorted(again)}): "
                             f"{str(err).splitlines()[0]}")
                log.error("restoring from %s failed: %s", source.value, err)
                survivors = [r for r in survivors if r not in again]
                decision = self.failure.after_restore_failure(source=source, lost=set(again),
                                                               survivors=len(survivors), attempt=attempt,
                                                               failures_so_far=self.failures, sources_left=left)
                if decision.action is not Action.FAIL:
                    self._end(again, f"restoring failed: {err}")
                    replacements = False
            except (ZeroRayError, CheckpointError) as err:  # the source itself cannot restore the run
                notes.append(f"restoring from {source.value} failed: {err}")
                log.error("restoring from %s failed: %s", source.value, err)
                if pool.generation != generation:
                    survivors = list(range(pool.world_size))
                decision = self.failure.after_source_failure(source=source, sources_left=left,
                                                              error=str(err).splitlines()[0])
            else:
                restored = Restored(source=source, resume_step=resume_step, world_size=pool.world_size,
                                    seconds=time.time() - t0)
                self._start_replacements(notes)
                return restored
            notes.append(f"{decision.action.value}: {decision.reason}")
            if decision.action is Action.FAIL:
                return NotRestored(reason=decision.reason)
            source = decision.source
        return NotRestored()

    def _restore_from(self, source: Source, survivors: list[int], target: int, committed_step: int,
                      load_checkpoint: Callable[[], int], *, lost: set[int]) -> int:
        if source is Source.REPLICA:
            return restore_from_replica(self._pool, self._topology, lost=lost, survivors=survivors, target=target,
                                        committed_step=committed_step,
                                        timeout_s=self._pool.spec.settle_timeout_s + 30)
        if source is Source.PEER:
            return self._restore_from_peers(survivors, target, committed_step)
        survivors, leaving = self._kept(survivors, target)  # shard groups: a multiple of G
        if leaving:
            self._pool.kill(leaving)
        self._pool.rebuild(survivors, target, restore=lambda position: None)
        return int(load_checkpoint())

    def _restore_from_peers(self, survivors: list[int], target: int, committed_step: int) -> int:
        """Rebuild from the snapshots the survivors hold; returns the steps completed in them."""
        pool = self._pool
        held = pool.snapshot_info(survivors, committed_step)
        taken = {(info.step, info.world_size) for infos in held.values() for info in infos.values()}
        if len(taken) != 1:
            raise CheckpointError(f"peer snapshots disagree on (step, world size): {sorted(taken)}, or none were taken")
        step, old_world = taken.pop()  # the layout they were taken in (a resize may have been cut short)
        # Fewer owners than survive go on (whole TP or shard groups): the highest leave, or with
        # TP those that cannot form a group on one node, so the copies must be held by those kept:
        # with TP the choice prefers the holders of copies no other kept survivor holds.
        kept, leaving = self._kept(survivors, target, copies={r: set(held[r]) for r in survivors})
        holder: dict[int, int] = {}
        for position, old in enumerate(kept):
            for rank in held[old]:
                holder.setdefault(rank, position)
        missing = sorted(set(range(old_world)) - set(holder))
        if missing:
            raise CheckpointError(f"no surviving peer holds a snapshot of ranks {missing} (their backups were lost "
                                  f"too{', or leave: ' + str(leaving) if leaving else ''}); restore from a "
                                  "checkpoint instead")
        description = next(i for r in kept for i in held[r].values()).description  # layout, merged table
        plan = PeerRestore(old_world=old_world, holders=tuple(holder[r] for r in range(old_world)),
                           description=description)
        if leaving:
            pool.kill(leaving)
        pool.rebuild(kept, target, restore=lambda position: plan)
        return step + 1

    def _kept(self, survivors: list[int], target: int,
              copies: dict[int, set[int]] | None = None) -> tuple[list[int], list[int]]:
        """The survivors that go on at ``target`` owners, in their new positions, and those that
        leave: the highest ranks beyond ``target``; with tensor parallelism, positions that put
        every TP group on one node (core/placement.group_survivors: after a loss, keeping the
        survivors' order could join two old groups' remainders on two nodes), preferring the
        holders of the old ranks' peer copies (``copies[r]``: those survivor r holds)."""
        pool = self._pool
        if pool.tensor_parallel == 1:
            leaving = self.scaling.leavers(survivors=survivors, target=target)
            return [r for r in survivors if r not in leaving], leaving
        nodes = [n.get("node_id", "") for n in pool.nodes]
        grouped = group_survivors(survivors, nodes, group_size=pool.tensor_parallel, target=target, copies=copies)
        return list(grouped.kept), list(grouped.leaving)

    def _start_replacements(self, notes: list[str]) -> None:
        """Continuing on the survivors: start the owners that bring the run back towards its
        desired size (as many as there is room for), to join once they answer (``grow_now``)."""
        pool = self._pool
        target = self.grow_target(pool.world_size) if self.scaling.continue_on_survivors else None
        if target is not None:
            pool.start_replacements(target)
            if pool.replacements.started is not None:
                notes.append(f"{target - pool.world_size} replacements starting, to join once up")

    def may_grow(self) -> bool:
        """Whether a grow back may be due at a coming step boundary (no side effects)."""
        return self._grow_back and self._pool.world_size < self.desired

    def grow_now(self) -> int | None:
        """The size to grow back to at this step boundary (``grow_back``), or None: the started
        replacements' once every one answers (None while they start; ended when they have not
        started within the start-up timeout); else, when the cluster has room for a larger size
        now (asked at most every ``grow_check_s``, and not right after a recovery), replacements
        are started for it (``continue_on_survivors``) and taken at a later boundary, or without
        it that size is grown to at once."""
        started = self._pool.replacements
        if not self._grow_back or self._pool.world_size >= self.desired:
            started.discard()  # a resize met the desired size first
            return None
        if started.started is not None:
            if started.ready():
                return started.started.world_size
            if not started.expired(self._pool.spec.init_timeout_s):
                return None
            log.warning("replacements did not start within %gs: ended", self._pool.spec.init_timeout_s)
            started.discard()
        now = time.monotonic()
        if now - self._last_grow_check < self._grow_check_s:
            return None
        self._last_grow_check = now
        target = self.grow_target(self._pool.world_size)
        if target is not None and self.scaling.continue_on_survivors:
            # Room came back after the loss (the lost owners' slots freed late: a cut-off node):
            # start replacements and go on, as after a loss, rather than a grow that waits for
            # their start (a process and torch: 9-11 s on the soak's loaded 2 cores, every step
            # stalled meanwhile). They join at the first boundary at which they answer.
            self._pool.start_replacements(target)
            if self._pool.replacements.started is not None:
                return None
        return target

    def grow_target(self, current: int) -> int | None:
        """A larger size to grow back to when the cluster has room again (never beyond the size
        the run should have), else None. With integer group sizes, a multiple of each (groups
        join whole); None with a ``"node"`` group size (``Topology.check_resize``)."""
        target = self.scaling.grow_to(current=current, free_slots=self._pool.free_slots(), desired=self.desired)
        multiple = self._topology.resize_multiple()
        if target is None or multiple is None:
            return None
        multiple = math.lcm(multiple, self._pool.tensor_parallel)
        target -= target % multiple
        return target if target > current else None
