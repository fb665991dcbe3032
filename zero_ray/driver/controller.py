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

from zero_ray.control.handlers import StepArgs, StepResult
from zero_ray.core.policy import Action
from zero_ray.core.position import Position
from zero_ray.driver.callbacks import Callbacks
from zero_ray.driver.data import GlobalBatch
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.driver.pool import OwnerPool
from zero_ray.driver.recovery import Outcome, RecoveryController, RecoveryReport, Replay, failed_error
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


class Controller:
    """The run's one loop over its calls, its position, and the recoveries carried out."""

    def __init__(self, *, pool: OwnerPool, life: Lifecycle, recovery: RecoveryController, replay: Replay,
                 callbacks: Callbacks, events: list[str], step_timeout_s: float, max_replay_steps: int,
                 load_checkpoint: Callable[[], int]) -> None:
        self._pool = pool
        self._life = life
        self.recovery = recovery
        self.replay = replay
        self._callbacks = callbacks
        self._events = events
        self._step_timeout_s = step_timeout_s
        self._keep = max_replay_steps
        self._load_checkpoint = load_checkpoint
        self.position = Position()
        self.target = 0  # steps the user's calls have completed (>= position.step)
        self.recoveries: list[RecoveryReport] = []
        self._restored_at = 0.0
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
    def execute(self, work: GlobalBatch) -> list[StepResult]:
        """Run the step at index ``position.step`` on ``work`` on every owner and count it."""
        generation = self._pool.generation
        at = self.position
        pieces, held = work.send(self._pool, world_size=self._pool.world_size, key=f"{generation}:{at.step}")
        args = [StepArgs(step=at.step, piece=piece, global_samples=work.samples, generation=generation,
                         samples_seen=at.samples_seen) for piece in pieces]
        with self._life.during(TrainerState.STEPPING, cause=f"step {at.step + 1}"):
            results = self._pool.step(args, timeout_s=self._step_timeout_s)
        del held  # the owners are done with the staged pieces: the object store frees them
        if results[0].refused:  # on_nonfinite="raise": every owner refused it alike
            raise NonFiniteError.refused(at.step + 1, results[0].nonfinite_loss_ranks,
                                         results[0].nonfinite_grad_ranks)
        self.position = at.after(work.samples)
        return results

    def step(self, work: GlobalBatch) -> list[StepResult]:
        """The user's next step: kept for a replay, run (after any replay), counted."""
        index = self.target
        self.replay.add(index, work)
        results = self.run(Call(name=f"step {index + 1}", attempt=lambda: self.execute(work), collective=True,
                                takes_step=True))
        self.target = index + 1
        return results

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
        self._life.move(TrainerState.RECOVERING, cause=f"{cause}: {type(err).__name__}", error=err)
        report = self.recovery.recover(err, failed_step=failed_step,
                                       step_started=time.time() - (time.perf_counter() - started),
                                       load_checkpoint=self._load_checkpoint, call=cause)
        if report.outcome is Outcome.RESTORED:
            assert report.resume_step is not None
            decision = self.recovery.failure.after_restore(
                resume_step=report.resume_step, missing=self.replay.missing(report.resume_step, until),
                keep=self._keep)
            if decision.action is Action.FAIL:
                report.outcome, report.decision, report.reason = Outcome.FAILED, decision.action.value, decision.reason
            else:
                samples = self.replay.samples(report.resume_step, self.position.step)
                self.position = Position(step=report.resume_step, samples_seen=self.position.samples_seen - samples)
                report.replayed_steps = until - report.resume_step
                report.replay_s = -1.0  # measured when the replay is done
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
