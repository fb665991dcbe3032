"""How a run continues where another left off: from a checkpoint (``from_checkpoint``,
``load_checkpoint``) or from a detached run's owners (``attach``), with its position and config.

Every checkpoint records the run's position (core/run_position.py), its whole ``ZeroConfig``
(``zero_ray.config_record``) and, apart, the settings that change its math
(``zero_ray.config.TRAINING_FIELDS``). A resume without a config restores the whole config (stage
and world size as saved); a passed config that would change the math is refused field by field
unless the caller names the fields in ``override``. A detached run's owners keep its config and
position, which ``attach`` takes back. Either way a restored setting that cannot hold here (a
checkpoint directory this driver cannot write) is an error naming it. ``ZeroTrainer``'s
``from_checkpoint``, ``saved_config``, ``load_checkpoint`` and ``attach`` call these functions with
what each needs of the run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
from zero_ray.core.optimizer_plan import OptimizerFactory, recorded_factories
from zero_ray.core.run_position import Position
from zero_ray.core.precision import dtype_name, parse_dtype
from zero_ray.driver.attach import FoundRun, find_run
from zero_ray.driver.callbacks import Callbacks
from zero_ray.driver.checkpointer import RunRecord
from zero_ray.driver.checkpoint_api import CheckpointAPI
from zero_ray.driver.controller import Controller
from zero_ray.driver.fit import RunExtras
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.driver.pool import OwnerPool
from zero_ray.errors import CollectiveError, ConfigError

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


def run_record(config: ZeroConfig, *, position: Position, world_size: int, extras: RunExtras) -> RunRecord:
    """What a checkpoint of the run now records besides the model state."""
    return RunRecord(position=position, world_size=world_size, stage=config.stage, training=training_record(config),
                     config=config_record(config, world_size=world_size), extra=dict(extras.saved))


def saved_config(path: str | os.PathLike[str], *, filesystem: Any = None) -> ZeroConfig:
    """See ``ZeroTrainer.saved_config``."""
    reader = CheckpointReader(path, filesystem=filesystem)
    restored = restored_config(reader.manifest, source=f"checkpoint {reader.path}", filesystem=filesystem)
    if restored.unrecorded:
        log.warning("checkpoint %s was saved with %s, which a checkpoint cannot record: saved_config() gives "
                    "the default; set it again", reader.path, restored.describe())
    return restored.config


@dataclass(frozen=True, kw_only=True)
class CheckpointStart:
    """What ``from_checkpoint`` starts a trainer with, read from the checkpoint's manifest
    before any owner starts."""

    path: str  # the checkpoint directory (a root's ``latest`` resolved)
    config: ZeroConfig
    optimizer: OptimizerFactory | list[OptimizerFactory]
    restored: bool  # the config is the checkpoint's (none was passed)

    def explain(self, err: BaseException) -> None:
        """Say, on a failure to start with it, where a restored config came from."""
        if self.restored:
            err.add_note(f"The run's config was restored from checkpoint {self.path}: "
                         "ZeroTrainer.saved_config(path) returns it; pass config= to change a setting.")


def checkpoint_start(path: str | os.PathLike[str], config: ZeroConfig | None, *, override: Sequence[str],
                     filesystem: Any, optimizer: OptimizerFactory | list[OptimizerFactory] | None) -> CheckpointStart:
    """The config and optimizer ``from_checkpoint`` starts with (``resume_config``; the
    checkpoint's optimizer unless one is passed), its manifest and file sizes checked."""
    reader = CheckpointReader(path, filesystem=filesystem)  # the manifest only: checked before owners start
    m = reader.manifest
    reader.check_files()
    resumed = resume_config(m, config, override=override, source=f"checkpoint {reader.path}", filesystem=filesystem)
    return CheckpointStart(path=reader.path, config=resumed, restored=config is None,
                           optimizer=optimizer if optimizer is not None else list(recorded_factories(m.optimizers)))


def load_checkpoint(path: str | os.PathLike[str], *, override: Sequence[str], filesystem: Any, config: ZeroConfig,
                    controller: Controller, life: Lifecycle, checkpoints: CheckpointAPI, extras: RunExtras) -> int:
    """See ``ZeroTrainer.load_checkpoint``: the run's ``config`` is checked against the
    checkpoint's; ``controller`` takes its position, ``extras`` its records."""
    names = check_overrides(override)

    def check(m: Manifest, where: str) -> None:
        refuse_conflicts(recorded_training(m), config, override=names, source=f"checkpoint {where}",
                         how="load_checkpoint")

    with controller.mutex:
        life.require_ready()
        try:
            m = checkpoints.load(path, filesystem, check=check)
        except ConfigError:  # refused before any owner read anything: the run is as it was
            raise
        except BaseException:
            life.move(TrainerState.FAILED)
            raise
        controller.settle(Position(step=m.step, samples_seen=m.samples_seen))
        extras.loaded(m.extra)
    return m.step


def find_detached(run_id: str, *, timeout_s: float) -> FoundRun:
    """The detached run ``attach`` takes over (Ray started if need be), its config checked to
    hold for this driver."""
    if not ray.is_initialized():
        ray.init()
    found = find_run(run_id, timeout_s=timeout_s)
    check_holds_here(found.run.config, source=f"detached run {run_id}")
    return found


def take_over(found: FoundRun, *, controller: Controller, pool: OwnerPool, callbacks: Callbacks) -> None:
    """Settle an adopted pool at the owners' position: nothing to do if every owner is idle
    at one step; else abort and re-form (or restore) as after a failed step."""
    at = found.position
    controller.settle(at)
    if found.settled:
        callbacks.on_event(f"attached to run {found.run_id} at step {at.step} ({pool.world_size} owners)")
        return
    err = CollectiveError(f"the previous driver left run {found.run_id} in the middle of step {at.step + 1}")
    report = controller.recover(err, started=time.perf_counter(), cause="attach")
    controller.raise_if_failed(err, report)
    callbacks.on_event(f"attached to run {found.run_id} at step {controller.position.step} "
                       f"({pool.world_size} owners)")
