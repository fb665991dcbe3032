"""How a run continues where another left off: from a checkpoint (``from_checkpoint``,
``load_checkpoint``) or from a detached run's owners (``attach``), with its position and the
settings that change its math.

Every checkpoint records the run's position (core/position.py) and its training configuration
(``zero_ray.config.TRAINING_FIELDS``). A resume without a config restores all of it (stage and
world size as saved); a config that would change the math is refused field by field unless the
caller names the fields in ``override``. A detached run's owners keep its config and position,
which ``attach`` takes back. ``ZeroTrainer`` inherits these methods (``ResumeAPI``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import ray

from zero_ray.checkpoint.format import Manifest
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.config import (
    ZeroConfig,
    check_overrides,
    config_from_training,
    refuse_conflicts,
    training_record,
)
from zero_ray.core.optim import OptimizerFactory, SchedulerFactory, recorded_factories
from zero_ray.core.position import Position
from zero_ray.core.precision import dtype_name, parse_dtype
from zero_ray.driver.attach import FoundRun, find_run
from zero_ray.driver.checkpointer import RunRecord
from zero_ray.driver.checkpoints import CheckpointAPI
from zero_ray.driver.controller import Controller
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.errors import CollectiveError, ConfigError
from zero_ray.owner.spec import LossFn, ModelFn

log = logging.getLogger(__name__)


def recorded_training(m: Manifest) -> dict[str, Any]:
    """The training configuration a checkpoint records; a format-2 one, which records none,
    gives what it did keep (compute dtype and seed)."""
    if m.training:
        return dict(m.training)
    return {"dtype": dtype_name(parse_dtype(m.compute_dtype)), "seed": m.seed}


def resume_config(m: Manifest, config: ZeroConfig | None, *, override: Sequence[str], source: str) -> ZeroConfig:
    """The config a resume from ``m`` runs with: ``config`` when it keeps the recorded math
    (or changes only fields named in ``override``), else the recorded one at the saved stage
    and world size. A conflict not overridden is a ConfigError naming the field and both values."""
    names = check_overrides(override)
    if config is None:
        if names:
            raise ConfigError(f"override={names!r} without config=: a resume without a config restores the "
                              f"checkpoint's settings, so there is nothing to override; pass the config to change")
        return config_from_training(recorded_training(m), stage=m.stage, world_size=m.world_size)
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config={config!r} must be a zr.ZeroConfig")
    for name, theirs, mine in refuse_conflicts(recorded_training(m), config, override=names, source=source,
                                               how="from_checkpoint"):
        log.warning("%s: %s changes from %r to %r (override)", source, name, theirs, mine)
    return config


class ResumeAPI:
    """The resume side of ``ZeroTrainer`` (mixed in)."""

    if TYPE_CHECKING:  # what these methods use of the trainer
        config: ZeroConfig
        _controller: Controller
        run_extra: dict[str, Any]
        resumed: dict[str, Any]
        events: list[str]
        _step_mutex: threading.RLock
        _life: Lifecycle
        _checkpoints: CheckpointAPI

        @property
        def world_size(self) -> int: ...

        def shutdown(self) -> None: ...

    @property
    def position(self) -> Position:
        """The run's position: steps completed (skipped ones included) and the samples they read.
        The owners hold the same, checkpoints record it and ``attach`` reads it back."""
        return self._controller.position

    def _record(self) -> RunRecord:
        """What a checkpoint of the run now records besides the model state."""
        cfg = self.config
        return RunRecord(position=self.position, world_size=self.world_size, stage=cfg.stage,
                         training=training_record(cfg), extra=dict(self.run_extra))

    # -- checkpoints -----------------------------------------------------------------------------------
    @staticmethod
    def saved_config(path: str | os.PathLike[str], *, filesystem: Any = None) -> ZeroConfig:
        """The ZeroConfig ``from_checkpoint(path, ...)`` resumes with when given none: the
        checkpoint's stage, world size and every setting that changes the math (defaults for
        the rest). ``dataclasses.replace`` it to change what does not, e.g. ``world_size``."""
        m = CheckpointReader(path, filesystem=filesystem).manifest
        return config_from_training(recorded_training(m), stage=m.stage, world_size=m.world_size)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], model_fn: ModelFn, loss_fn: LossFn, *,
                        optimizer: OptimizerFactory | list[OptimizerFactory] | None = None,
                        lr_scheduler: SchedulerFactory | None = None, config: ZeroConfig | None = None,
                        override: Sequence[str] = (), filesystem: Any = None, callbacks: Sequence[Any] = ()) -> Self:
        """Resume from a checkpoint (a checkpoint directory, or a root whose ``latest`` is used;
        a path, a URL, or a path in ``filesystem``) at any stage and world size: each owner reads
        only the ranges its new partition needs (ranged GETs on an object store).

        ``config`` defaults to the checkpoint's: stage and world size as saved and every setting
        that changes the math (``grad_accum_steps``, ``max_grad_norm``, dtypes, ``seed``,
        ``loss_scale``, ``optimizer_kinds``, ``on_nonfinite``, the ``topology``'s quantized
        collectives (``weight_comm``, ``grad_comm``); ``saved_config(path)`` returns
        it). A config that sets any of those otherwise is a ConfigError naming the field and both
        values, unless ``override`` names it (e.g. ``override=("max_grad_norm",)``); stage, world
        size and every other field may differ freely. ``optimizer`` defaults to the checkpoint's
        (its classes and groups, rebuilt by parameter name); a different optimizer is refused,
        naming both. The optimizers' state, group hyperparameters and the scheduler's state come
        from the checkpoint; a run saved with a scheduler needs the same ``lr_scheduler``
        factory again. ``step_count`` and ``samples_seen`` continue from the checkpoint: feed
        the batches from there on to continue as the uninterrupted run.
        """
        reader = CheckpointReader(path, filesystem=filesystem)  # the manifest only: checked before owners start
        m = reader.manifest
        reader.check_files()
        config = resume_config(m, config, override=override, source=f"checkpoint {reader.path}")
        opt = optimizer if optimizer is not None else list(recorded_factories(m.optimizers))
        trainer = cls(model_fn, loss_fn, optimizer=opt, lr_scheduler=lr_scheduler, config=config,  # type: ignore[call-arg]
                      callbacks=callbacks)
        try:
            trainer.load_checkpoint(reader.path, override=override, filesystem=filesystem)
        except BaseException:
            trainer.shutdown()
            raise
        return trainer

    def load_checkpoint(self, path: str | os.PathLike[str], *, override: Sequence[str] = (),
                        filesystem: Any = None) -> int:
        """Overwrite this run's model state, optimizer state and position with a checkpoint (a
        directory, or a root's ``latest``; a path, a URL, or a path in ``filesystem``) saved at
        any stage and world size; returns the step it continues from. A checkpoint saved with
        settings that change the math otherwise than this run's config is refused before
        anything loads, naming the fields, unless ``override`` names them. The manifest and file
        sizes are checked first, and each rank reads and verifies all its ranges before changing
        anything; if a rank still fails (a corrupt block) others may have loaded, so the trainer
        is then marked failed."""
        names = check_overrides(override)

        def check(m: Manifest, where: str) -> None:
            refuse_conflicts(recorded_training(m), self.config, override=names, source=f"checkpoint {where}",
                             how="load_checkpoint")

        with self._step_mutex:
            self._life.require_ready()
            try:
                m = self._checkpoints.load(path, filesystem, check=check)
            except ConfigError:  # refused before any owner read anything: the run is as it was
                raise
            except BaseException:
                self._life.move(TrainerState.FAILED)
                raise
            self._controller.settle(Position(step=m.step, samples_seen=m.samples_seen))
            self.run_extra, self.resumed = dict(m.extra), dict(m.extra)
        return m.step

    # -- a driver taking over a detached run ----------------------------------------------------------
    @classmethod
    def attach(cls, run_id: str, model_fn: ModelFn, loss_fn: LossFn, *,
               optimizer: OptimizerFactory | list[OptimizerFactory] | None = None,
               lr_scheduler: SchedulerFactory | None = None, timeout_s: float = 60.0,
               callbacks: Sequence[Any] = ()) -> Self:
        """Continue a detached run (``ElasticConfig(detached=True)``) whose driver is gone, from
        its owners' memory (no storage is read): from a new driver process, such as a
        resubmitted Ray job. ``model_fn`` must build the same model (checked against the owners'
        layout); ``optimizer`` and ``lr_scheduler`` (the factories replacement owners build from)
        default to the run's, whose state the owners keep. The run's ``ZeroConfig`` comes from the
        owners, and so does its position: ``step_count`` and ``samples_seen`` say how far the
        owners got: feed the batches from there on (``fit`` does so by itself). Owners caught in
        the middle of a step are aborted and re-formed (or restored from peer copies when a rank
        had begun its update)."""
        if not ray.is_initialized():
            ray.init()
        found = find_run(run_id, timeout_s=timeout_s)
        run = found.run
        config: ZeroConfig = run["config"]
        return cls(model_fn, loss_fn, optimizer=optimizer if optimizer is not None else run["optimizer"],  # type: ignore[call-arg]
                   lr_scheduler=lr_scheduler if lr_scheduler is not None else run.get("lr_scheduler"),
                   config=config, callbacks=callbacks, _found=found)

    def _take_over(self, found: FoundRun) -> None:
        """Settle an adopted pool at the owners' position: nothing to do if every owner is idle
        at one step; else abort and re-form (or restore) as after a failed step."""
        at = found.position
        self._controller.settle(at)
        if found.settled:
            self._callbacks.on_event(f"attached to run {found.run_id} at step {at.step} ({self.world_size} owners)")
            return
        err = CollectiveError(f"the previous driver left run {found.run_id} in the middle of step {at.step + 1}")
        report = self._controller.recover(err, started=time.perf_counter(), cause="attach")
        self._controller.raise_if_failed(err, report)
        self._callbacks.on_event(f"attached to run {found.run_id} at step {self._controller.position.step} "
                                 f"({self.world_size} owners)")

