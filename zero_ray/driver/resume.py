"""How a run continues where another left off: from a checkpoint (``from_checkpoint``,
``load_checkpoint``) or from a detached run's owners (``attach``), with its position and config.

Every checkpoint records the run's position (core/position.py), its whole ``ZeroConfig``
(``zero_ray.config_record``) and, apart, the settings that change its math
(``zero_ray.config.TRAINING_FIELDS``). A resume without a config restores the whole config (stage
and world size as saved); a passed config that would change the math is refused field by field
unless the caller names the fields in ``override``. A detached run's owners keep its config and
position, which ``attach`` takes back. Either way a restored setting that cannot hold here (a
checkpoint directory this driver cannot write) is an error naming it. ``ZeroTrainer`` inherits
these methods (``ResumeAPI``).
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
from zero_ray.checkpoint.location import url_scheme
from zero_ray.config import (
    ZeroConfig,
    check_overrides,
    config_from_training,
    refuse_conflicts,
    training_record,
)
from zero_ray.config_record import FILESYSTEM_FIELD, RestoredConfig, config_record, restore_config
from zero_ray.core.optim import OptimizerFactory, SchedulerFactory, recorded_factories
from zero_ray.core.position import Position
from zero_ray.core.precision import dtype_name, parse_dtype
from zero_ray.driver.attach import FoundRun, find_run
from zero_ray.driver.checkpointer import RunRecord
from zero_ray.driver.checkpoint_api import CheckpointAPI
from zero_ray.driver.controller import Controller
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.errors import CollectiveError, ConfigError
from zero_ray.owner.step.spec import LossFn, ModelFn

log = logging.getLogger(__name__)


def recorded_training(m: Manifest) -> dict[str, Any]:
    """The training configuration a checkpoint records; a format-2 one, which records none,
    gives what it did keep (compute dtype and seed)."""
    if m.training:
        return dict(m.training)
    return {"dtype": dtype_name(parse_dtype(m.compute_dtype)), "seed": m.seed}


def restored_config(m: Manifest, *, source: str, filesystem: Any = None) -> RestoredConfig:
    """The config a resume without one runs with: the run's whole recorded ``ZeroConfig`` (its
    stage and its world size when saved), the checkpoint ``filesystem`` it is read through
    standing in for a recorded filesystem object. A format-2/3 checkpoint recorded only the settings that change
    the math: those, with defaults for the rest (logged)."""
    if m.config:
        supply = {FILESYSTEM_FIELD: filesystem} if filesystem is not None else {}
        return restore_config(m.config, supply=supply)
    log.warning("%s (format %d) records only the settings that change the math; its other settings (offload, "
                "elastic, checkpoint, ...) are at their defaults: pass config= to set them", source, m.format_version)
    return RestoredConfig(config=config_from_training(recorded_training(m), stage=m.stage, world_size=m.world_size))


def check_holds_here(config: ZeroConfig, *, source: str) -> None:
    """Refuse a restored config whose settings cannot hold for this driver: a local
    ``checkpoint.dir`` it cannot create or write (it writes every manifest there)."""
    where = config.checkpoint.dir
    if where is None or config.checkpoint.filesystem is not None or url_scheme(os.fspath(where)) is not None:
        return
    existing = os.path.abspath(os.fspath(where))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not (os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK)):
        raise ConfigError(f"{source} was saved with checkpoint.dir={os.fspath(where)!r}, which this driver cannot "
                          f"write ({existing!r} is not a writable directory); pass config= with another "
                          "CheckpointConfig(dir=...), e.g. dataclasses.replace(ZeroTrainer.saved_config(path), "
                          "checkpoint=zr.CheckpointConfig(dir=...))")


def resume_config(m: Manifest, config: ZeroConfig | None, *, override: Sequence[str], source: str,
                  filesystem: Any = None) -> ZeroConfig:
    """The config a resume from ``m`` runs with: ``config`` when it keeps the recorded math
    (or changes only fields named in ``override``), else the whole recorded one at the saved
    stage and world size. A conflict not overridden is a ConfigError naming the field and both
    values; so is a recorded setting that cannot be rebuilt or cannot hold here."""
    names = check_overrides(override)
    if config is None:
        if names:
            raise ConfigError(f"override={names!r} without config=: a resume without a config restores the "
                              f"checkpoint's settings, so there is nothing to override; pass the config to change")
        restored = restored_config(m, source=source, filesystem=filesystem)
        if restored.unrecorded:
            raise ConfigError(f"{source} was saved with {restored.describe()}, which a checkpoint cannot record; "
                              "pass config= with it, e.g. config=dataclasses.replace(ZeroTrainer.saved_config(path), "
                              "...) setting it again")
        check_holds_here(restored.config, source=source)
        return restored.config
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
                         training=training_record(cfg), config=config_record(cfg, world_size=self.world_size), extra=dict(self.run_extra))

    # -- checkpoints -----------------------------------------------------------------------------------
    @staticmethod
    def saved_config(path: str | os.PathLike[str], *, filesystem: Any = None) -> ZeroConfig:
        """The ZeroConfig ``from_checkpoint(path, ...)`` resumes with when given none: the run's
        whole config, at the checkpoint's stage and world size. ``dataclasses.replace`` it to
        change what you want to, e.g. ``world_size``; everything else stays as the run had it. A
        setting a checkpoint cannot record (a wrap policy's function, a filesystem object other
        than ``filesystem``) comes back at its default, with a warning naming it: set it again."""
        reader = CheckpointReader(path, filesystem=filesystem)
        restored = restored_config(reader.manifest, source=f"checkpoint {reader.path}", filesystem=filesystem)
        if restored.unrecorded:
            log.warning("checkpoint %s was saved with %s, which a checkpoint cannot record: saved_config() gives "
                        "the default; set it again", reader.path, restored.describe())
        return restored.config

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], model_fn: ModelFn, loss_fn: LossFn, *,
                        optimizer: OptimizerFactory | list[OptimizerFactory] | None = None,
                        lr_scheduler: SchedulerFactory | None = None, config: ZeroConfig | None = None,
                        override: Sequence[str] = (), filesystem: Any = None, callbacks: Sequence[Any] = ()) -> Self:
        """Resume from a checkpoint (a checkpoint directory, or a root whose ``latest`` is used;
        a path, a URL, or a path in ``filesystem``) at any stage and world size: each owner reads
        only the ranges its new partition needs (ranged GETs on an object store).

        ``config`` defaults to the run's whole config as saved (stage, world size, offload,
        elastic, checkpoint, stage3, device, ...; ``saved_config(path)`` returns it); a recorded
        setting that cannot hold here (a ``checkpoint.dir`` this driver cannot write) or that a
        checkpoint cannot record (a wrap policy's function) is a ConfigError naming it. A config
        passed that sets a setting that changes the math (``grad_accum_steps``,
        ``max_grad_norm``, dtypes, ``seed``, ``loss_scale``, ``optimizer_kinds``,
        ``on_nonfinite``, the ``topology``'s quantized collectives) otherwise is a ConfigError
        naming the field and both values, unless ``override`` names it (e.g.
        ``override=("max_grad_norm",)``); stage, world size and every other field may differ. ``optimizer`` defaults to the checkpoint's
        (its classes and groups, rebuilt by parameter name); a different optimizer is refused,
        naming both. The optimizers' state, group hyperparameters and the scheduler's state come
        from the checkpoint; a run saved with a scheduler needs the same ``lr_scheduler``
        factory again. ``step_count`` and ``samples_seen`` continue from the checkpoint: feed
        the batches from there on to continue as the uninterrupted run.
        """
        reader = CheckpointReader(path, filesystem=filesystem)  # the manifest only: checked before owners start
        m = reader.manifest
        reader.check_files()
        restoring = config is None
        config = resume_config(m, config, override=override, source=f"checkpoint {reader.path}", filesystem=filesystem)
        opt = optimizer if optimizer is not None else list(recorded_factories(m.optimizers))
        try:
            trainer = cls(model_fn, loss_fn, optimizer=opt, lr_scheduler=lr_scheduler,  # type: ignore[call-arg]
                          config=config, callbacks=callbacks)
        except Exception as err:
            if restoring:
                err.add_note(f"The run's config was restored from checkpoint {reader.path}: "
                             "ZeroTrainer.saved_config(path) returns it; pass config= to change a setting.")
            raise
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
        config = run.config
        check_holds_here(config, source=f"detached run {run_id}")
        return cls(model_fn, loss_fn, optimizer=optimizer if optimizer is not None else run.optimizer,  # type: ignore[call-arg]
                   lr_scheduler=lr_scheduler if lr_scheduler is not None else run.lr_scheduler,
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

