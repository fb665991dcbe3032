"""Stepper: the calls that move a run forward on its owners, one at a time.

A step, an evaluation and a dataset given to every owner each run through the controller's
loop; the stepper holds the controller's mutex over a step or an evaluation, so that an
operator's checkpoint or resize (a gRPC thread) lands between two of them, never inside one.
A completed step goes to Ray metrics (``RunMetrics.completed``, recorded on their own timer) and
to the callbacks watching steps (the operators' Metrics stream while one is open, the user's),
and a grow back that is due runs through ``grow``. ``ZeroTrainer`` builds it over its
controller and pool and holds it; ``fit`` steps through it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from zero_ray.config import ZeroConfig
from zero_ray.control.handlers import EvaluateArgs
from zero_ray.driver.batch_staging import EvaluateCommand, GlobalBatch
from zero_ray.driver.callbacks import Callbacks
from zero_ray.driver.controller import Call, Controller
from zero_ray.driver.lifecycle import Lifecycle
from zero_ray.driver.pool import OwnerPool
from zero_ray.driver.reports import StepMetrics
from zero_ray.errors import ConfigError, NonFiniteError

log = logging.getLogger(__name__)

# A grow back to the run's desired size: the target world size -> whatever the resize reports.
Grow = Callable[[int], object]


class Stepper:
    """Steps, evaluations and dataset registrations on the owners, each under ``mutex``."""

    def __init__(self, *, controller: Controller, pool: OwnerPool, life: Lifecycle, config: ZeroConfig,
                 callbacks: Callbacks, completed: deque[StepMetrics], grow: Grow) -> None:
        self.mutex: threading.RLock = controller.mutex
        self.last_metrics: StepMetrics | None = None  # of the last step completed
        self._controller = controller
        self._pool = pool
        self._life = life
        self._config = config
        self._callbacks = callbacks
        self._completed = completed  # each step's metrics, for Ray metrics to record on their own timer
        self._grow = grow
        self._evaluations = 0  # names each evaluation's staging key

    @property
    def world_size(self) -> int:
        return self._pool.world_size

    @property
    def step_count(self) -> int:
        """Steps completed: the run's ``position.step``."""
        return self._controller.position.step

    @property
    def stop_requested(self) -> bool:
        """An operator asked the run to stop; a training loop should end."""
        return self._life.stop_reason is not None

    def step(self, work: GlobalBatch, *, ahead: GlobalBatch | None = None) -> StepMetrics:
        """One optimizer step on ``work``; ``ahead`` goes to the owners while it runs."""
        with self.mutex:
            self._life.require_ready()
            cfg = self._config
            n = work.samples
            tp = cfg.tensor_parallel.size  # a TP group's owners read one piece
            if n < self.world_size // tp * cfg.grad_accum_steps:
                per = " / tensor_parallel" if tp > 1 else ""
                raise ConfigError(f"global batch of {n} samples is smaller than world_size{per} * grad_accum_steps = "
                                  f"{self.world_size // tp} * {cfg.grad_accum_steps}; every rank needs at least one "
                                  "sample per micro-batch")
            start = time.perf_counter()
            reply = self._controller.step(work, ahead=ahead)
            metrics = StepMetrics.of(reply, step=self.step_count, samples=n, seconds=time.perf_counter() - start,
                                     sent_ahead=self._controller.last_sent_ahead)
            if metrics.nonfinite_loss_ranks is not None:  # on_nonfinite="skip"
                text = NonFiniteError.describe(self.step_count, reply.nonfinite_loss_ranks,
                                               reply.nonfinite_grad_ranks) + "; skipped"
                log.warning(text)
                self._callbacks.on_event(text)
            self.last_metrics = metrics
            self._completed.append(metrics)
            if self._callbacks.steps_watched:  # no observer of steps (the default): nothing to tell
                self._callbacks.on_step(metrics, reply)
            self._controller.grow(self._grow)
            return metrics

    def evaluate(self, work: GlobalBatch) -> dict[str, float]:
        """The loss on ``work`` at the current parameters, forward only (``ZeroTrainer.evaluate``)."""
        with self.mutex:
            self._life.require_ready()
            cfg = self._config
            if work.samples < self.world_size * cfg.grad_accum_steps:
                raise ConfigError(f"an evaluation batch of {work.samples} samples is smaller than world_size * "
                                  f"grad_accum_steps = {self.world_size} * {cfg.grad_accum_steps}")

            def attempt() -> dict[str, float]:
                generation = self._pool.generation
                self._evaluations += 1
                out = work.split(world_size=self.world_size, key=f"{generation}:eval{self._evaluations}",
                                 tensor_parallel=self._pool.tensor_parallel)
                held = (out, self._pool.stage(out))
                totals = self._pool.evaluate(EvaluateCommand(
                    evaluate=EvaluateArgs(piece=out.piece, generation=generation), out=out),
                    timeout_s=cfg.step_timeout_s)
                del held
                return totals.figures()

            return self._controller.run(Call(name="evaluate", attempt=attempt, collective=True))

    def register_dataset(self, name: str, source: Any, *, factory: bool, collate: Any) -> int:
        """Give every owner the dataset ``name`` (fit's data setup); its length."""
        return self._controller.run(Call(name=f"registering the {name} dataset", attempt=lambda: (
            self._pool.register_dataset(name, source, factory=factory, collate=collate))))
