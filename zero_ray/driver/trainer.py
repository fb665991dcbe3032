"""ZeroTrainer: what users call, and the controller that runs a step.

It composes the driver's parts (Ray Train v2's split): the lifecycle state machine
(``lifecycle.py``), the owners' membership and placement (``pool.py``, calls through
``fanout.py``), failure handling (``recovery.py``: policies decide, the controller acts), the
checkpoint API (``checkpoint_api.py``), resuming from a checkpoint or a detached run's owners
(``resume.py``), the calls that step and evaluate (``stepper.py``), the data path
(``batch_staging.py``, ``fit.py``), the operators' service (``coordinator.py``) and the specs a
config starts the owners with (``run_specs.py``). Each is handed the parts it works with, never
the trainer.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Self

import ray
import torch

from zero_ray.checkpoint.storage import Storage
from zero_ray.config import ZeroConfig
from zero_ray.control.auth import Credentials, new_token, write_token_file
from zero_ray.control.handlers import JobStatus
from zero_ray.control.server import ServerConfig, serve_coordinator
from zero_ray.core.batching import Batch
from zero_ray.core.devices import choose_device
from zero_ray.core.stall_diagnosis import diagnose
from zero_ray.core.optimizer_plan import (
    AdamW,
    OptimizerFactory,
    SchedulerFactory,
    check_optimizer_factories,
    check_scheduler_factory,
)
from zero_ray.core.elastic_policy import FailurePolicy, ScalingPolicy
from zero_ray.core.run_position import Position
from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
from zero_ray.driver.attach import FoundRun, check_layout
from zero_ray.driver.callbacks import Callback, Callbacks, EventLog, check_callbacks
from zero_ray.driver.checkpoint_api import CheckpointAPI
from zero_ray.driver.checkpointer import RunRecord
from zero_ray.driver.controller import AfterRecovery, Call, Controller
from zero_ray.driver.coordinator import Coordinator
from zero_ray.driver import desired_size
from zero_ray.driver.batch_staging import Replay, StagedBatch
from zero_ray.driver.fit import FitRun, RunExtras, fit
from zero_ray.driver.lifecycle import Lifecycle, TrainerState
from zero_ray.driver.metrics import RunMetrics
from zero_ray.driver.pool import Adopted, OwnerPool
from zero_ray.driver.pool_spec import cluster_is_local
from zero_ray.driver.recovery import RecoveryController, RecoveryReport
from zero_ray.driver.replica_restore import resize_groups
from zero_ray.driver.reports import ResizeReport, StepMetrics
from zero_ray.driver import resume
from zero_ray.driver.run_specs import engine_spec, pool_spec
from zero_ray.driver.stepper import Stepper
from zero_ray.driver.tp_consolidation import join_fragments, split_dims, whole_counts
from zero_ray.errors import ConfigError, ZeroRayError
from zero_ray.owner.step.run_spec import LossFn, ModelFn

log = logging.getLogger(__name__)

__all__ = ["TrainerState", "ZeroTrainer"]


def _ensure_ray() -> None:
    # ray.init() connects to a running cluster (RAY_ADDRESS or a local `ray start`) and
    # otherwise starts a local one in-process.
    if not ray.is_initialized():
        ray.init()


def _resolve_device(config: ZeroConfig) -> tuple[str, str]:
    choice = choose_device(device=config.device, backend=config.backend, world_size=config.world_size,
                           cluster_gpus=ray.cluster_resources().get("GPU", 0.0), one_machine=cluster_is_local())
    # "auto" falling back to the CPU is said loudly on a cluster: where GPU nodes are autoscaled it is a mistake.
    log.log(logging.WARNING if choice.warn else logging.INFO, "%s", choice.reason)
    return choice.device, choice.backend


class ZeroTrainer:
    """Train ``model_fn()`` with ZeRO data parallelism over ``config.world_size`` Ray actors.

    model_fn: zero-argument callable returning a ``torch.nn.Module``; runs on every actor after
        ``torch.manual_seed(config.seed)``, so every rank starts from identical parameters.
        Parameters with ``requires_grad=False`` are frozen (held, never updated).
    loss_fn: ``(module, batch) -> loss``: the mean loss over that batch, or the pair
        ``(loss_sum, count)`` (the sum of per-item losses and how many items it covers: the step
        then trains on the exact mean over every item of the global batch).
    optimizer: a factory ``model -> torch.optim.Optimizer`` written as in one process (any param
        groups and hyperparameters, from ``model.parameters()`` or ``named_parameters()``), or a
        list of them (e.g. Muon for the hidden matrices, AdamW for the rest). Every owner calls
        it on its own model and runs that class over its partition. Default ``zr.AdamW()``.
    lr_scheduler: a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``, applied to
        each optimizer and stepped once per optimizer step; or None.
    config: a ``zr.ZeroConfig``.
    callbacks: ``zr.Callback`` instances told of every state change (with its cause), completed
        step, committed checkpoint and event (resize, recovery, attach), as Ray Train's
        callbacks are. One that raises is logged; the run goes on.
    """

    def __init__(self, model_fn: ModelFn, loss_fn: LossFn, *,
                 optimizer: OptimizerFactory | list[OptimizerFactory] | None = None,
                 lr_scheduler: SchedulerFactory | None = None, config: ZeroConfig | None = None,
                 callbacks: Sequence[Callback] = (), _found: FoundRun | None = None) -> None:
        if not callable(model_fn):
            raise ConfigError(f"model_fn={model_fn!r} must be a zero-argument callable returning a torch.nn.Module")
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} must be a callable (module, batch) -> loss or (loss_sum, count)")
        if config is not None and not isinstance(config, ZeroConfig):
            raise ConfigError(f"config={config!r} must be a zr.ZeroConfig")
        self.config = cfg = config if config is not None else ZeroConfig()
        self.optimizer = optimizer if optimizer is not None else AdamW()
        factories = check_optimizer_factories(self.optimizer)
        self.lr_scheduler = check_scheduler_factory(lr_scheduler)
        observers = check_callbacks(callbacks)
        _ensure_ray()
        self.device, backend = _resolve_device(cfg)
        self._engine = engine_spec(cfg, model_fn=model_fn, loss_fn=loss_fn, optimizers=factories,
                                   lr_scheduler=self.lr_scheduler, device=self.device)
        if _found is not None:
            self._credentials = ray.get(_found.actors[0].credentials.remote(), timeout=cfg.init_timeout_s)
        else:
            self._credentials = Credentials(job_id=uuid.uuid4().hex[:12], token=new_token())
        elastic = cfg.elastic
        pool = pool_spec(cfg, device=self.device, backend=backend, optimizer=self.optimizer,
                         lr_scheduler=self.lr_scheduler)
        self._run_metrics = RunMetrics(run_id=self._credentials.job_id)
        self._life = Lifecycle()
        self._event_log = EventLog()
        self.events = self._event_log.events  # membership changes and failure decisions, for operators
        self._callbacks = Callbacks([self._event_log, *observers], states=self._life)
        self._extras = RunExtras()  # what checkpoints record beside the state: fit()'s data order
        adopt = None
        if _found is not None:
            check_layout(_found, model_fn, seed=cfg.seed)
            adopt = Adopted(actors=_found.actors, generation=_found.generation, layout=_found.layout)
        self._pool = OwnerPool(pool, self._engine, credentials=self._credentials, adopt=adopt)
        self._checkpoints = CheckpointAPI(self._pool, cfg.checkpoint)
        # attached: the last resize's size, which the owners' config does not hold (None: never
        # resized, or started by a release that recorded none)
        resized = desired_size.recorded(_found.run_id) if _found is not None else None
        self._recovery = RecoveryController(
            self._pool, failure=FailurePolicy(max_failures=cfg.max_failures, backoff_s=elastic.backoff_s),
            scaling=ScalingPolicy(min_world_size=elastic.min_world_size, max_world_size=elastic.max_world_size,
                                  continue_on_survivors=elastic.continue_on_survivors and elastic.grow_back),
            desired=cfg.world_size if resized is None else resized,
            peer_redundancy=elastic.redundancy == "peer",
            grow_back=elastic.grow_back, grow_check_s=elastic.grow_check_s,
            checkpoint_root=self._checkpoints.recovery_root, topology=cfg.topology)
        self._controller = Controller(pool=self._pool, life=self._life, recovery=self._recovery,
                                      replay=Replay(elastic.max_replay_steps), callbacks=self._callbacks,
                                      events=self.events, step_timeout_s=cfg.step_timeout_s,
                                      max_replay_steps=elastic.max_replay_steps, snapshot_every=pool.snapshot_every,
                                      load_checkpoint=lambda: self._checkpoints.load_latest().step)
        self._stepper = Stepper(controller=self._controller, pool=self._pool, life=self._life, config=cfg,
                                callbacks=self._callbacks, completed=self._run_metrics.completed,
                                grow=lambda target: self._resize(target, desired=self._recovery.desired))
        self._coordinator = Coordinator(status=lambda flight: self.job_status(flight=flight),
                                        stop=self._life.request_stop, checkpoint=self.checkpoint_now, resize=self.resize,
                                        watchers=self._callbacks)  # steps' metrics, while a Metrics stream is open
        host = "127.0.0.1" if cluster_is_local() else ray.util.get_node_ip_address()
        self._server = serve_coordinator(self._coordinator, ServerConfig(host=host, credentials=self._credentials,
                                                                               **pool.server_tls()))
        token_dir = cfg.control_token_dir or tempfile.mkdtemp(prefix="zero_ray-")
        self.control_token_file: str = str(write_token_file(os.path.join(token_dir, f"{self._credentials.job_id}.token"),
                                                            self._credentials))
        self.num_params: int = self._pool.model.numel
        self.num_trainable_params: int = self._pool.model.trainable_numel
        if cfg.tensor_parallel.size > 1:  # the owners' layout holds a TP slice: count the whole model
            self.num_params, self.num_trainable_params = whole_counts(model_fn)
        if _found is not None:
            resume.take_over(_found, controller=self._controller, pool=self._pool, callbacks=self._callbacks)
        log.info("zero_ray: stage %d, %d owners on %s/%s, %d parameters", cfg.stage, self.world_size, self.device,
                 backend, self.num_params)
        self._run_metrics.start()
        try:  # model-state bytes are on the metrics endpoint from the start; best effort
            self.memory_report()
        except ZeroRayError as err:
            log.warning("could not record the start-up memory report: %s", err)

    # -- properties for operators ---------------------------------------------------------------
    @property
    def control_address(self) -> str:
        """``HOST:PORT`` of the driver's Coordinator service (``zero-ray status --address``)."""
        return self._server.address

    @property
    def run_id(self) -> str:
        """The ``run_id`` tag on this run's Ray metrics (also its control-plane job id, and what
        ``ZeroTrainer.attach`` takes)."""
        return self._credentials.job_id

    @property
    def state(self) -> TrainerState:
        return self._life.state

    @property
    def stop_reason(self) -> str | None:
        return self._life.stop_reason

    @property
    def stop_requested(self) -> bool:
        """An operator asked the run to stop (``zero-ray stop``); the loop should end."""
        return self._life.stop_reason is not None

    def request_stop(self, reason: str) -> str:
        """Ask the run to stop after the step in flight; returns the state afterwards."""
        return self._life.request_stop(reason)

    @property
    def world_size(self) -> int:
        return len(self._pool.actors)

    @property
    def step_count(self) -> int:
        """Steps completed (skipped ones included): the run's ``position.step``."""
        return self._controller.position.step

    @property
    def samples_seen(self) -> int:
        """The samples those steps read: the run's ``position.samples_seen``."""
        return self._controller.position.samples_seen

    @property
    def position(self) -> Position:
        """The run's position: steps completed (skipped ones included) and the samples they read.
        The owners hold the same, checkpoints record it and ``attach`` reads it back."""
        return self._controller.position

    @property
    def recoveries(self) -> list[RecoveryReport]:
        """Every recovery carried out, oldest first."""
        return self._controller.recoveries

    @property
    def desired_world_size(self) -> int:
        """The size the run should have (where it started, or the last resize); a loss may leave
        it smaller until the cluster has room again."""
        return self._recovery.desired

    @property
    def last_metrics(self) -> StepMetrics | None:
        """The metrics of the last step completed (None before the first)."""
        return self._stepper.last_metrics

    @property
    def actors(self) -> list[Any]:
        """The partition owners' Ray actor handles, in rank order."""
        return list(self._pool.actors)

    def job_status(self, *, flight: bool = False) -> JobStatus:
        """A snapshot for the Coordinator's Status call (thread-safe); with ``flight``, every
        owner's flight record read now and diagnosed (``core/stall_diagnosis.py``)."""
        lines: tuple[str, ...] = ()
        if flight:
            flights, unreachable = self._pool.flights(timeout_s=2.0)
            diagnosis = diagnose(flights, unreachable=unreachable)
            lines = (diagnosis.text().splitlines()[0], *diagnosis.lines)
        return JobStatus(flight=lines, world_size=self.world_size, stage=self.config.stage, step=self.step_count,
                         last_loss=self.last_metrics.loss if self.last_metrics else float("nan"),
                         state=self._life.state.value,
                         ranks=tuple(self._pool.rank_statuses()), events=tuple(self.events[-20:]))

    # -- training ---------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepMetrics:
        """One optimizer step on the global ``batch`` (split along dim 0 across the owners).

        Returns metrics (a ``StepMetrics``, read as a mapping too: ``metrics["loss"]``):
        ``loss`` (mean over the global batch before the update: over items when
        ``loss_fn`` returns ``(loss_sum, count)``, else over samples), ``grad_norm`` (before
        clipping), ``lr``, ``skipped`` (fp16 overflow, or a non-finite step under
        ``on_nonfinite="skip"``, which adds ``nonfinite_loss_ranks`` and ``nonfinite_grad_ranks``),
        ``loss_scale``, ``samples``, ``items`` (the count, or tokens of an integer batch, or
        samples) and ``items_per_second``, ``step_seconds``, ``data_wait_seconds`` (the slowest
        owner's wait for its piece of the batch), ``sent_ahead`` (``fit`` sent this step to the
        owners while the step before it ran; never here). Under ``on_nonfinite="raise"`` a
        non-finite step raises ``NonFiniteError`` having changed nothing: ``step()`` again.
        """
        return self._stepper.step(StagedBatch(batch))

    def evaluate(self, batch: Batch) -> dict[str, float]:
        """The loss on the global ``batch`` at the current parameters, forward only on every
        owner (module in eval mode, no gradients, nothing changes). Returns ``loss`` (the mean
        over items when ``loss_fn`` returns ``(loss_sum, count)``, else over samples),
        ``samples`` and ``items``, and ``count`` for the pair form."""
        return self._stepper.evaluate(StagedBatch(batch))

    def fit(self, dataset: Any, *, global_batch_size: int, steps: int, seed: int = 0,
            collate_fn: Callable[[list[Any]], Any] | None = None, eval_dataset: Any = None,
            eval_every: int | None = None, checkpoint_every: int | None = None,
            progress: bool = True, callback: Callable[[StepMetrics], None] | None = None) -> dict[str, Any]:
        """Train until ``step_count`` reaches ``steps`` on a map-style ``dataset`` (``__len__`` and
        ``__getitem__``: a ``torch.utils.data.Dataset``, a Hugging Face ``datasets.Dataset``) or a
        zero-argument factory building one, which goes to every owner once, or on a source each
        owner reads itself (``zr.data.TokenFiles``, ``Parquet``, a ``ray.data.Dataset``: docs/data.md).
        Each owner builds its pieces with ``collate_fn`` (default ``default_collate``) from the
        indices the step RPC carries.

        Order (fixed): epoch ``e`` is ``torch.randperm(len(dataset),
        generator=torch.Generator().manual_seed(seed + e))``; global batches are consecutive
        slices of ``global_batch_size``; a partial last batch is dropped; a global batch is split
        among ranks as ``step()`` splits one. So it matches single-process training on that
        order, survives resizes and lost owners (a replay re-reads the same indices), and after
        ``from_checkpoint`` continues at the right epoch and offset.

        ``eval_dataset`` is evaluated (``evaluate``, every sample once, in order) every
        ``eval_every`` steps and at the end; ``checkpoint_every`` saves under
        ``config.checkpoint.dir``. Shows a progress bar (loss, items/s, eval loss) unless
        ``progress=False``; ``callback(metrics)`` is called after every step (with ``eval_loss``
        when it evaluated). Returns the last ``loss``, ``eval_loss``, ``items_per_second``,
        ``step`` and ``epoch``."""
        run = FitRun(stepper=self._stepper, extras=self._extras, checkpoint_dir=self.config.checkpoint.dir,
                     save_checkpoint=self.save_checkpoint)
        return fit(run, dataset, global_batch_size=global_batch_size, steps=steps, seed=seed, collate_fn=collate_fn,
                   eval_dataset=eval_dataset, eval_every=eval_every, checkpoint_every=checkpoint_every,
                   progress=progress, callback=callback)

    # -- reports and consolidation ------------------------------------------------------------------
    def memory_report(self) -> list[dict[str, int]]:
        """Per rank, model-state bytes by category, measured from the tensors at the last step's
        peak (every gradient present: the paper's per-device figure). Gradients are released
        after each update, so between steps a rank holds ``total`` less ``grads``
        (``grads_between_steps`` says what stays). On CUDA each report adds the caching
        allocator's figures (``cuda_allocated``, ``cuda_reserved``, their peaks and
        ``cuda_fragmentation``: reserved but unallocated at the peak), which include activations."""
        reports = self._controller.run(Call(name="memory_report", needs_ready=False, attempt=lambda: (
            self._pool.memory_reports(timeout_s=self.config.init_timeout_s))))
        self._run_metrics.record_memory(reports)
        return reports

    def comm_report(self) -> list[dict[str, int]]:
        """Per rank, bytes sent in the last step by collective, in all, split into the
        tensor-parallel layers' (``tensor_parallel``) and ZeRO's (``data_parallel``), and inside /
        across nodes (recorded in Ray metrics per rank too: a step's own record is the run's total
        only)."""
        reports = self._controller.run(Call(name="comm_report", needs_ready=False, attempt=lambda: (
            self._pool.comm_reports(timeout_s=self.config.init_timeout_s))))
        self._run_metrics.record_comm(reports)
        return reports

    def full_state_dict(self, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The fp32 parameters as ``{name: CPU tensor}``, names and shapes as in
        ``model_fn().named_parameters()``. This is the explicit consolidation: the whole model
        passes through the driver. ``trainable_only``: just the parameters with
        ``requires_grad=True`` (a PEFT adapter's weights, without the frozen base model)."""
        model = self._pool.model
        shapes = {n: s for n, s in model.shapes.items() if n in model.trainable or not trainable_only}
        # Stage 0 owners each hold all of a parameter; sharded owners a range of it; with tensor
        # parallelism, of their TP rank's shard, joined along the plan's dimensions.
        gathered = self._controller.run(Call(name="full_state_dict", needs_ready=False, attempt=lambda: (
            self._pool.master_fragments(timeout_s=self.config.init_timeout_s))))
        tp = self.config.tensor_parallel
        dims = split_dims(self._engine.model_fn, tp) if tp.size > 1 else {}
        return join_fragments(gathered, local_shapes=shapes, size=tp.size, dims=dims)

    # -- elasticity -------------------------------------------------------------------------------------
    def resize(self, world_size: int) -> ResizeReport:
        """Continue with ``world_size`` partition owners, live: new owners start (or surplus ones
        stop, their slots going back to the cluster) and every partition range whose owner
        changes moves directly between actors through collectives; nothing goes through
        storage or the driver. The global batch stays as it is (each rank's share changes), so
        training continues as the uninterrupted run. ``world_size`` becomes the run's desired
        size (what it grows back to after a loss). Returns the sizes, bytes sent and seconds
        taken (a ``ResizeReport``, read as a mapping too: ``report["world_size"]``). A loss
        during the transfer aborts it at once: the run is recovered (peer copies or a
        checkpoint) and ``ResizeInterrupted`` raised, or the run fails with the reason.
        With shard groups or hpZ the size is a multiple of the group sizes: groups join and leave
        whole, a new group taking the first group's live state. With tensor parallelism the size
        is a multiple of T: D changes, T stays, and each TP shard reshards over its D owners."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
        # keeps T: whole TP groups join or leave (ConfigError naming the sizes that work)
        TensorParallelRanks(world_size=world_size, size=self.config.tensor_parallel.size)
        self._recovery.scaling.check_resize(world_size)
        self.config.topology.check_resize(self.world_size, world_size)
        return self._resize(world_size, desired=world_size)

    def _resize(self, world_size: int, *, desired: int) -> ResizeReport:
        def attempt() -> ResizeReport:
            if world_size == self.world_size:
                return ResizeReport.unchanged(world_size)
            self._checkpoints.wait(raise_error=False)  # a save in flight reads the current owners
            with self._life.during(TrainerState.RESIZING, cause=f"{self.world_size} -> {world_size} owners",
                                   world_size=world_size):
                return (self._pool.resize(world_size) if self.config.topology.shard_group_size is None
                        else resize_groups(self._pool, self.config.topology, world_size,
                                           timeout_s=self.config.init_timeout_s))

        report = self._controller.run(Call(name=f"resizing to {world_size} owners", attempt=attempt, collective=True,
                                           after_recovery=AfterRecovery.INTERRUPTED))
        if self.config.elastic.detached and desired != self._recovery.desired:  # a driver attaching reads it
            desired_size.record(self.run_id, desired)
        self._recovery.desired = desired
        if report.previous_world_size != world_size:
            self._callbacks.on_event(f"step {self.step_count}: resized {report.previous_world_size} -> "
                                     f"{world_size} owners ({report.bytes_sent} bytes moved in "
                                     f"{report.seconds:.2f}s)")
        return report

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str] | None = None, *, wait: bool = False,
                        filesystem: Any = None) -> str:
        """Save a sharded checkpoint under the root ``path`` (default ``config.checkpoint.dir``
        and its filesystem) and return its directory (``path/step-NNNNNNNN``).

        ``path`` is a local or shared directory, a URL (``s3://bucket/prefix``, ``gs://...``,
        ``file://...``) or, with ``filesystem`` (a ``pyarrow.fs.FileSystem`` or an fsspec
        filesystem), a path inside that filesystem. Training stalls only while every owner
        copies its slices to host memory; each owner writes (uploads) its own file in the
        background and the checkpoint is committed (manifest last, then ``latest``) once every
        rank's file is complete. ``wait=True`` (or ``wait_for_checkpoint()``) blocks until then;
        with ``wait=True`` an owner lost while writing is recovered from and the save taken again
        (as one lost in the snapshot is). A crash before the commit leaves the previous
        checkpoint the latest.
        """
        return self._save(self._checkpoints.open(path, filesystem, what="save_checkpoint()"), wait=wait)[0]

    def checkpoint_now(self, path: str | None) -> tuple[str, int]:
        """The Coordinator's Checkpoint call: save after the step in flight; (directory, step)."""
        return self._save(self._checkpoints.open(path or None, what="this job's checkpoint (zero-ray checkpoint "
                                                                    "now PATH)"), wait=False)

    def _save(self, root: tuple[Storage, str], *, wait: bool) -> tuple[str, int]:
        def attempt() -> tuple[str, int]:
            record = self._record()
            target = self._checkpoints.save(*root, record,
                                            on_commit=lambda path: self._callbacks.on_checkpoint(path, record.step))
            if wait:  # a failure the policy recovers from (an owner lost while writing) is raised
                # here, so the save is taken again as after one lost in the snapshot; any other
                # (a storage failure) is the caller's, from wait_for_checkpoint below
                failure = self._checkpoints.join()
                if failure is not None and self._controller.recovery.failure.needs_recovery(failure,
                                                                                            collective=False):
                    raise failure
            return target, record.step

        target, step = self._controller.run(Call(name="save_checkpoint", attempt=attempt))
        if wait:
            self.wait_for_checkpoint()
        return target, step

    def wait_for_checkpoint(self, timeout_s: float | None = None) -> str | None:
        """Block until the save in flight is committed; returns the newest committed directory.
        Raises CheckpointError if that save was abandoned (the previous one stays latest)."""
        return self._checkpoints.wait(timeout_s)

    def export_pretrained(self, directory: str | os.PathLike[str], *, max_shard_size: str | int = "5GB",
                          dtype: str | None = None, filesystem: Any = None) -> list[str]:
        """Write the current weights into ``directory`` (a path, a URL, or a path in
        ``filesystem``) as Hugging Face ``save_pretrained`` writes them (``model.safetensors``,
        or shards and ``model.safetensors.index.json`` above ``max_shard_size``); with the
        model's ``config.json`` there, ``from_pretrained`` loads it (from a local copy, for an
        object store). Memory stays bounded: every owner writes its shard to a checkpoint under
        ``directory`` (removed afterwards) and the files are streamed from it. Returns the files
        written."""
        return self._controller.run(Call(name="export_pretrained", attempt=lambda: self._checkpoints.export(
            directory, self._record(), max_shard_size=max_shard_size, dtype=dtype, filesystem=filesystem)))

    def _record(self) -> RunRecord:
        """What a checkpoint of the run now records besides the model state."""
        return resume.run_record(self.config, position=self.position, world_size=self.world_size, extras=self._extras)

    # -- resuming (resume.py) ----------------------------------------------------------------------------
    @staticmethod
    def saved_config(path: str | os.PathLike[str], *, filesystem: Any = None) -> ZeroConfig:
        """The ZeroConfig ``from_checkpoint(path, ...)`` resumes with when given none: the run's
        whole config, at the checkpoint's stage and world size. ``dataclasses.replace`` it to
        change what you want to, e.g. ``world_size``; everything else stays as the run had it. A
        setting a checkpoint cannot record (a wrap policy's function, a filesystem object other
        than ``filesystem``) comes back at its default, with a warning naming it: set it again."""
        return resume.saved_config(path, filesystem=filesystem)

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
        start = resume.checkpoint_start(path, config, override=override, filesystem=filesystem, optimizer=optimizer)
        try:
            trainer = cls(model_fn, loss_fn, optimizer=start.optimizer, lr_scheduler=lr_scheduler, config=start.config,
                          callbacks=callbacks)
        except Exception as err:
            start.explain(err)
            raise
        try:
            trainer.load_checkpoint(start.path, override=override, filesystem=filesystem)
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
        return resume.load_checkpoint(path, override=override, filesystem=filesystem, config=self.config,
                                      controller=self._controller, life=self._life, checkpoints=self._checkpoints,
                                      extras=self._extras)

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
        found = resume.find_detached(run_id, timeout_s=timeout_s)
        run = found.run
        return cls(model_fn, loss_fn, optimizer=optimizer if optimizer is not None else run.optimizer,
                   lr_scheduler=lr_scheduler if lr_scheduler is not None else run.lr_scheduler,
                   config=run.config, callbacks=callbacks, _found=found)

    # -- the end ---------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the owners (a detached run's too) and the control server, after a save in flight
        commits. Idempotent."""
        if self._life.state is TrainerState.SHUT_DOWN:
            return
        try:
            self._checkpoints.wait(raise_error=False)
        except ZeroRayError as err:
            log.error("shutting down with a checkpoint still being written: %s", err)
        self._server.stop(grace_s=0.5)
        self._pool.shutdown()
        self._run_metrics.close()  # the steps not yet recorded are
        if self.config.elastic.detached:
            desired_size.forget(self.run_id)
        self._life.move(TrainerState.SHUT_DOWN)
        try:
            os.unlink(self.control_token_file)
        except OSError:
            pass

    def __enter__(self) -> ZeroTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
