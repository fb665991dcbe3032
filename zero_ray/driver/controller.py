"""The controller loop: every call that reaches the owners runs through ``Controller.run``.

As in Ray Train v2's ``TrainController``, there is one loop, and failures are handled in one
place. A call (a step, an evaluation, a save, an export, a report, registering data, a resize)
is a typed ``Call``. ``run`` first replays the kept batches a restore rewound past (so that
every call sees the state the user's calls have reached), then attempts the call. When it
fails, the policies say whether the failure needs recovery
(``FailurePolicy.needs_recovery``); if so, ``recover`` carries out their decision (re-form,
restore, fail) and the policies decide again whether the kept batches still cover the replay
(``FailurePolicy.after_restore``). The call is then run again on the recovered owners, or, for
a resize, reported as interrupted. So an owner lost between two calls is recovered by whichever
call finds it, exactly as a loss found by a step is.

The run's position is held here, once (``Position``: steps completed in the owners' state and
the samples they read), with ``target``: the steps the user's calls have completed. The two
differ only while a restore's replay catches up.

Pipelined steps (``fit``): ``step(work, ahead=next)`` sends the next step to the owners before
collecting this one (``StepArgs.ahead``; ``owner/service/step_order.py`` runs it there after this one,
and never if this one failed), so the owners find their next command waiting and the driver's
work for a step overlaps their compute. The step sent ahead is collected by the next ``step``
call naming the same batch; any other call first collects it (``_land``) and counts it, keeping
its reply for that ``step`` call. A recovery drops it: the step before it failed somewhere, so
it cannot complete anywhere. It is not sent when the step before takes a peer snapshot (its
commit would wait a step longer) or a grow may be due (``RecoveryController.may_grow``, asked once
per membership).

Paths that reach the owners outside ``run`` (each one a deliberate exception; the pool's own
fan-out aborts the survivors of a loss on all of them alike):

- ``ZeroTrainer.job_status`` -> ``OwnerPool.flights`` / ``rank_statuses``: an operator's status
  is read while a step holds the mutex (seeing a stalled step is its point), on the fan-out's
  urgent threads, and never fails: an owner that does not answer is reported, not recovered.
  ``RecoveryController`` reads the flights the same way inside a recovery.
- ``resume.load_checkpoint`` -> ``CheckpointAPI.load`` -> ``OwnerPool.load``: under the mutex, not
  in ``run``. A failure after the owners began reading leaves partitions from two states; a
  recovery would bring back the state before the load (peer copies, or the last committed save,
  which is not the one asked for) and load again, so the failure marks the run FAILED and raises
  instead, with no policy consulted. (Running it as a ``Call`` whose recovery reloads is the fix
  left for later: it changes what a failed ``load_checkpoint`` leaves behind.) A load the
  controller asks for while restoring (``load_latest``) is inside ``recover``.
- ``resume.take_over`` -> ``Controller.recover``: attaching has no call to attempt; owners left
  mid-step by the previous driver are recovered as after a failed step, then the first call runs.
- ``CheckpointAPI.open`` -> ``OwnerPool.use_filesystem``: a filesystem object is shipped (a Ray
  call: it is pickled) before a save or load names it, once per filesystem, outside ``run``
  for ``save_checkpoint``. It changes no training state; a failure raises to the caller with
  the run as it was, and an owner lost meanwhile is found by the next call.
- ``Checkpointer``'s commit thread -> ``OwnerPool.save(SavePhase.AWAIT)``: after the snapshot
  (inside the save's call, under the mutex) the owners write in the background while training
  goes on; the commit waits for them outside the loop and the mutex, or every step would wait
  for the write. It changes no training state: a failure abandons that checkpoint (reported by
  ``wait_for_checkpoint`` / the callbacks), and a loss is found by the next call.

Step numbering: ``position.step`` counts completed steps. The step at index ``k`` (0-based: the
``k``-th batch of ``fit``'s order, ``StepArgs.step``, ``RecoveryReport.failed_step``) takes the
position from ``k`` to ``k + 1`` and is called step ``k + 1`` in messages and metrics
(``metrics["step"]`` is the position after it).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from zero_ray.control.handlers import StepArgs
from zero_ray.core.reply_combine import CombinedStep
from zero_ray.core.run_position import Position
from zero_ray.driver.callbacks import Callbacks
from zero_ray.driver.batch_staging import GlobalBatch, IndexedBatch, Outgoing, Replay, StepCommand
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.driver.fanout import StepFlight
from zero_ray.driver.pool import OwnerPool
from zero_ray.driver.recovery import Outcome, RecoveryController, RecoveryReport, failed_error
from zero_ray.errors import NonFiniteError, ResizeInterrupted, ResourceError, ZeroRayError

log = logging.getLogger(__name__)

T = TypeVar("T")


class AfterRecovery(enum.Enum):
    """What becomes of a call whose failure was recovered from."""

    RUN_AGAIN = "run_again"  # attempted again on the recovered owners (after the replay)
    INTERRUPTED = "interrupted"  # not repeated: the caller is told (ResizeInterrupted)


@dataclass(frozen=True, kw_only=True)
class Call(Generic[T]):
    """One call on the owners. ``collective``: it runs collectives there (any failure may leave
    an owner mid-collective); ``needs_ready``: it changes or reads the training state and may
    not start while the run is stepping, resizing or stopping (reports only need the run alive)."""

    name: str
    attempt: Callable[[], T]
    collective: bool = False
    after_recovery: AfterRecovery = AfterRecovery.RUN_AGAIN
    needs_ready: bool = True
    takes_step: bool = False  # the user's next step: a restore replays up to and including it


@dataclass(frozen=True, kw_only=True)
class Ahead:
    """A step sent while the one before it runs (``Controller.step``'s ``ahead``)."""

    index: int
    generation: int
    work: GlobalBatch
    flight: StepFlight


@dataclass(frozen=True, kw_only=True)
class Landed:
    """A step sent ahead that another call collected first: its reply, for its ``step`` call."""

    index: int
    work: GlobalBatch
    reply: CombinedStep


class Controller:
    """The run's one loop over its calls, its position, and the recoveries carried out."""

    def __init__(self, *, pool: OwnerPool, life: Lifecycle, recovery: RecoveryController, replay: Replay,
                 callbacks: Callbacks, events: list[str], step_timeout_s: float, max_replay_steps: int,
                 snapshot_every: int, load_checkpoint: Callable[[], int]) -> None:
        self._pool = pool
        self._life = life
        self.recovery = recovery
        self.replay = replay
        self._callbacks = callbacks
        self._events = events
        self._step_timeout_s = step_timeout_s
        self._keep = max_replay_steps
        self._snapshot_every = snapshot_every  # peer snapshots every this many steps (0: none)
        self._load_checkpoint = load_checkpoint
        self.position = Position()
        self.target = 0  # steps the user's calls have completed (>= position.step)
        self.recoveries: list[RecoveryReport] = []
        self._restored_at = 0.0
        self._ahead: Ahead | None = None  # the step in flight behind the current one
        self._landed: Landed | None = None
        self.last_sent_ahead = False  # the last step executed had been sent while the one before ran
        self._grow_asked: tuple[tuple[int, int], bool] | None = None  # (generation, desired) -> may_grow
        # Held for a whole call, so that an operator's checkpoint (a gRPC thread) lands between
        # steps on every rank alike.
        self.mutex = threading.RLock()

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, call: Call[T]) -> T:
        """Attempt ``call`` until it succeeds, recovering from failures as the policies decide."""
        with self.mutex:
            (self._life.require_ready if call.needs_ready else self._life.require_alive)()
            started = time.perf_counter()
            while True:
                try:
                    if not call.takes_step:  # a step collects the one sent ahead itself
                        self._land()
                    self._catch_up()
                    result = call.attempt()
                except ZeroRayError as err:
                    if not self.recovery.failure.needs_recovery(err, collective=call.collective):
                        raise
                    report = self.recover(err, started=started, cause=call.name,
                                          until=self.target + int(call.takes_step))
                    self.raise_if_failed(err, report)
                    if call.after_recovery is AfterRecovery.INTERRUPTED:
                        raise ResizeInterrupted(f"{call.name} failed ({err}); the run was restored at "
                                                f"{self._pool.world_size} owners and continues with the next step"
                                                ) from err
                    if report.outcome is Outcome.REFORMED and not report.retry:
                        raise  # the call's own error (e.g. the loss function's): the caller's to handle
                    log.info("%s: running it again after the recovery", call.name)
                else:
                    self._replayed()
                    return result

    def settle(self, position: Position) -> None:
        """Take ``position`` as the run's (a loaded checkpoint, an attached run's owners)."""
        self.position = position
        self.target = position.step

    # -- steps -------------------------------------------------------------------------------------
    def execute(self, work: GlobalBatch, *, ahead: GlobalBatch | None = None) -> CombinedStep:
        """Run the step at index ``position.step`` on ``work`` on every owner and count it;
        ``ahead``: send the step after it before waiting for this one."""
        generation = self._pool.generation
        at = self.position
        held = None
        sent, self._ahead = self._ahead, None
        self.last_sent_ahead = sent is not None and (sent.index, sent.generation, sent.work) == (at.step, generation,
                                                                                                  work)
        if self.last_sent_ahead:
            assert sent is not None
            flight = sent.flight
        else:
            assert sent is None, f"step {sent.index + 1} was sent ahead, but step {at.step + 1} runs next"
            out = work.split(world_size=self._pool.world_size, key=f"{generation}:{at.step}",
                             tensor_parallel=self._pool.tensor_parallel)
            held = (out, self._pool.stage(out))
            flight = self._pool.start_step(self._command(at, work, out, ahead=False),
                                           timeout_s=self._step_timeout_s)
        try:
            if ahead is not None and self._pipelines(at.step, ahead):
                following = ahead.split(world_size=self._pool.world_size, key=f"{generation}:{at.step + 1}",
                                         tensor_parallel=self._pool.tensor_parallel)
                # Its deadline counts from when this step is collected (below); gRPC's is an outer bound.
                args = self._command(at.after(work.samples), ahead, following, ahead=True)
                self._pool.stage(following)  # nothing for a dataset's pieces, the only ones sent ahead
                self._ahead = Ahead(index=at.step + 1, generation=generation, work=ahead,
                                    flight=self._pool.start_step(args, timeout_s=2 * self._step_timeout_s))
            reply = self._collect(flight, at.step)
        except BaseException:
            self._drop_ahead()  # this step failed somewhere: the one sent ahead runs nowhere
            raise
        del held  # the owners are done with the staged pieces: the object store frees them
        if self._ahead is not None:
            self._ahead.flight.expire_in(self._step_timeout_s)
        self.position = at.after(work.samples)
        return reply

    def _collect(self, flight: StepFlight, index: int) -> CombinedStep:
        """Wait for step ``index``'s reply from every owner (the run STEPPING meanwhile)."""
        with self._life.during(TrainerState.STEPPING, cause=f"step {index + 1}"):
            reply = self._pool.collect(flight)
        if reply.agreed is not None and reply.agreed.value.refused:  # on_nonfinite="raise": every owner alike
            raise NonFiniteError.refused(index + 1, reply.nonfinite_loss_ranks, reply.nonfinite_grad_ranks)
        return reply

    def _command(self, at: Position, work: GlobalBatch, out: Outgoing, *, ahead: bool) -> StepCommand:
        return StepCommand(step=StepArgs(step=at.step, piece=out.piece, global_samples=work.samples,
                                         generation=self._pool.generation, samples_seen=at.samples_seen, ahead=ahead),
                           out=out)

    def _pipelines(self, index: int, ahead: GlobalBatch) -> bool:
        """Whether the step after step ``index`` may be sent while it runs: a dataset's batch
        (nothing staged), no peer snapshot after this step, no grow due."""
        every = self._snapshot_every
        return (isinstance(ahead, IndexedBatch) and not (every and (index + 1) % every == 0)
                and not self._may_grow())

    def _may_grow(self) -> bool:
        """``RecoveryController.may_grow``, asked once per membership (a new world size is a new
        generation) and desired size, not every step: only a resize or a recovery changes it."""
        key = (self._pool.generation, self.recovery.desired)
        if self._grow_asked is None or self._grow_asked[0] != key:
            self._grow_asked = (key, self.recovery.may_grow())
        return self._grow_asked[1]

    def _land(self) -> None:
        """Collect the step sent ahead before another call uses the owners, and count it."""
        sent, self._ahead = self._ahead, None
        if sent is None:
            return
        self.replay.add(sent.index, sent.work)
        reply = self._collect(sent.flight, sent.index)
        self.position = self.position.after(sent.work.samples)
        self.target = max(self.target, sent.index + 1)
        self._landed = Landed(index=sent.index, work=sent.work, reply=reply)

    def _drop_ahead(self) -> None:
        sent, self._ahead, self._landed = self._ahead, None, None
        if sent is not None:
            sent.flight.cancel()

    def step(self, work: GlobalBatch, *, ahead: GlobalBatch | None = None) -> CombinedStep:
        """The user's next step: kept for a replay, run (after any replay), counted. ``ahead``:
        the batch of the step after it, sent to the owners while this one runs (``fit``)."""
        landed, self._landed = self._landed, None
        if landed is not None and landed.work is work and landed.index == self.target - 1:
            self.last_sent_ahead = True
            return landed.reply  # sent ahead, collected and counted by another call
        index = self.target
        self.replay.add(index, work)
        reply = self.run(Call(name=f"step {index + 1}", attempt=lambda: self.execute(work, ahead=ahead),
                                collective=True, takes_step=True))
        self.target = index + 1
        return reply

    def _catch_up(self) -> None:
        """Replay the kept batches until the position reaches the user's (after a restore)."""
        while self.position.step < self.target:
            self.execute(self.replay[self.position.step])

    def _replayed(self) -> None:
        """A call succeeded: time the replay the last recovery asked for, if it is now done."""
        report = self.recoveries[-1] if self.recoveries else None
        if report is not None and report.replay_s < 0:  # time the replay that recovery asked for
            report.replay_s = time.perf_counter() - self._restored_at
            if self._events and self._events[-1].startswith(report.summary().split(";")[0]):
                self._events[-1] = report.summary()

    # -- failures ----------------------------------------------------------------------------------
    def recover(self, err: ZeroRayError, *, started: float, cause: str, until: int | None = None) -> RecoveryReport:
        """Carry out the policies' decision after ``err`` (in ``cause``: a step, a save, an
        attach...). Restored: the position is rewound to the restored step, to be replayed from
        the kept batches up to step index ``until`` (default: where the user's calls are). Every
        outcome is recorded and told to the callbacks."""
        until = self.target if until is None else until
        failed_step = self.position.step
        self._drop_ahead()
        self._life.move(TrainerState.RECOVERING, cause=f"{cause}: {type(err).__name__}", error=err)
        report = self.recovery.recover(err, failed_step=failed_step,
                                       step_started=time.time() - (time.perf_counter() - started),
                                       load_checkpoint=self._load_checkpoint, call=cause, replay=self.replay,
                                       until=until, keep=self._keep)
        if report.outcome is Outcome.RESTORED:  # the kept batches cover the replay (the policies checked)
            assert report.resume_step is not None
            samples = self.replay.samples(report.resume_step, self.position.step)
            self.position = Position(step=report.resume_step, samples_seen=self.position.samples_seen - samples)
            self._restored_at = time.perf_counter()
        self.recoveries.append(report)
        self._callbacks.on_event(report.summary())
        log.warning("recovery: %s (%s)", report.summary(), report.reason)
        failed = report.outcome is Outcome.FAILED
        self._life.move(TrainerState.FAILED if failed else TrainerState.READY, cause=report.summary(),
                        error=err if failed else None, world_size=self._pool.world_size, recovery=report)
        return report

    def raise_if_failed(self, err: ZeroRayError, report: RecoveryReport) -> None:
        """Raise ``err`` again, saying why the run ended, when ``report`` failed the run."""
        if report.outcome is not Outcome.FAILED:
            return
        new = failed_error(err, report)
        if new is None:
            raise err
        raise new from err

    def grow(self, resize: Callable[[int], object]) -> None:
        """Grow back towards the desired size when the recovery controller says so (``grow_now``:
        replacements started after a loss are up, or the cluster has room again)."""
        if self._ahead is not None:  # the owners are busy with the next step: at a later boundary
            return
        if not self._may_grow() and self._pool.replacements.started is None:
            return  # at the desired size with no replacements to end: grow_now would do nothing
        target = self.recovery.grow_now()
        if target is None:
            return
        log.info("growing back %d -> %d owners", self._pool.world_size, target)
        try:
            resize(target)
        except ResourceError as err:  # the room went to someone else: try again later
            log.info("growing back deferred: %s", err)
        except ResizeInterrupted as err:
            log.warning("growing back was interrupted and recovered: %s", err)
