"""ZeroTrainer: what users call. It starts the partition owners, splits each global batch
among them through Ray's object store, and combines their replies into a step's metrics."""

from __future__ import annotations

import enum
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray import cloudpickle

from zero_ray.config import ZeroConfig
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.core.optim import AdamW, Optimizer, optimizer_from_record, optimizer_record
from zero_ray.core.precision import parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.control.auth import Credentials, new_token, write_token_file
from zero_ray.control.handlers import JobStatus, MetricsEvent, RankStatus, StepArgs
from zero_ray.control.server import ServerConfig, serve_coordinator
from zero_ray.core.policy import Action, FailurePolicy
from zero_ray.driver.checkpointer import Checkpointer, RunPosition
from zero_ray.driver.coordinator import Coordinator
from zero_ray.driver.metrics import RunMetrics
from zero_ray.driver.pool import OwnerPool, PoolSpec, _cluster_is_local
from zero_ray.errors import ConfigError, ResourceError, StopRequested, ZeroRayError
from zero_ray.owner.engine import EngineSpec, LossFn, ModelFn

log = logging.getLogger(__name__)


class TrainerState(enum.Enum):
    """The run's lifecycle, as the controller moves it."""

    READY = "ready"
    STEPPING = "stepping"
    RECOVERING = "recovering"  # aborting collectives and re-forming the group after a failure
    RESIZING = "resizing"  # moving partitions to a new number of owners
    STOPPING = "stopping"  # an operator asked the run to stop; step() refuses new steps
    FAILED = "failed"  # the owners' state can no longer be trusted
    SHUT_DOWN = "shut_down"


def _ensure_ray() -> None:
    # ray.init() connects to a running cluster (RAY_ADDRESS or a local `ray start`) and
    # otherwise starts a local one in-process.
    if not ray.is_initialized():
        ray.init()


def _unpin(refs: list[ray.ObjectRef]) -> None:
    """Serializing an ObjectRef out of band (into a gRPC message) pins it for the life of the
    driver; once the step is over the owners are done with it, so take that pin back."""
    core_worker = ray._private.worker.global_worker.core_worker
    for ref in refs:
        try:
            core_worker.remove_object_ref_reference(ref)
        except Exception:  # best effort: a leak of one batch is not worth failing a step for
            log.debug("could not unpin %s", ref, exc_info=True)


def _resolve_device(config: ZeroConfig) -> tuple[str, str]:
    device = config.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0.0) >= config.world_size else "cpu"
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


class ZeroTrainer:
    """Train ``model_fn()`` with ZeRO data parallelism over ``config.world_size`` Ray actors.

    model_fn: zero-argument callable returning a ``torch.nn.Module``; runs on every actor after
        ``torch.manual_seed(config.seed)``, so every rank starts from identical parameters.
    loss_fn: ``(module, batch) -> scalar tensor``, the mean loss over that batch.
    optimizer: ``zr.AdamW(...)`` (default) or ``zr.SGD(...)``.
    config: a ``zr.ZeroConfig``.
    """

    def __init__(self, model_fn: ModelFn, loss_fn: LossFn, *, optimizer: Optimizer | None = None,
                 config: ZeroConfig | None = None) -> None:
        if not callable(model_fn):
            raise ConfigError(f"model_fn={model_fn!r} must be a zero-argument callable returning a torch.nn.Module")
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn={loss_fn!r} must be a callable (module, batch) -> scalar tensor")
        self.config = config if config is not None else ZeroConfig()
        self.optimizer = optimizer if optimizer is not None else AdamW()
        self._schedule: Callable[[int], float] = self.config.lr_schedule or (lambda step: 1.0)
        _ensure_ray()
        device, backend = _resolve_device(self.config)
        self.device = device
        cfg = self.config
        engine = EngineSpec(model_fn=model_fn, loss_fn=loss_fn, optimizer=self.optimizer, plan=stage_plan(cfg.stage),
                            compute_dtype=parse_dtype(cfg.dtype), device=device, seed=cfg.seed,
                            bucket_bytes=cfg.bucket_bytes, grad_accum_steps=cfg.grad_accum_steps,
                            max_grad_norm=cfg.max_grad_norm, loss_scale=cfg.loss_scale, stage3=cfg.stage3,
                            init_state_dict=cfg.init_state_dict)
        pool = PoolSpec(world_size=cfg.world_size, use_gpu=device == "cuda", num_cpus_per_owner=cfg.num_cpus_per_owner,
                        backend=backend, placement_strategy=cfg.placement_strategy,
                        collective_timeout_s=cfg.collective_timeout_s, init_timeout_s=cfg.init_timeout_s,
                        health_interval_s=cfg.health_interval_s, health_timeout_s=cfg.health_timeout_s,
                        tls=cfg.control_tls)
        self._credentials = Credentials(job_id=uuid.uuid4().hex[:12], token=new_token())
        self._run_metrics = RunMetrics(run_id=self._credentials.job_id)
        self._policy = FailurePolicy(max_failures=cfg.max_failures)
        self._failures = 0
        self._lock = threading.Lock()
        # Held for a whole step and for a save's snapshot, so that an operator's checkpoint
        # (a gRPC thread) lands between steps on every rank alike.
        self._step_mutex = threading.RLock()
        self._state = TrainerState.READY
        self.step_count = 0
        self.samples_seen = 0
        self.last_metrics: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.events: list[str] = []  # membership changes and failure decisions, for operators
        self._pool = OwnerPool(pool, engine, credentials=self._credentials)
        self._checkpointer = Checkpointer(self._pool, keep=cfg.checkpoint.keep, timeout_s=cfg.checkpoint.timeout_s)
        self._coordinator = Coordinator(self)
        host = "127.0.0.1" if _cluster_is_local() else ray.util.get_node_ip_address()
        self._server = serve_coordinator(self._coordinator, ServerConfig(host=host, credentials=self._credentials,
                                                                               **pool.server_tls()))
        token_dir = cfg.control_token_dir or tempfile.mkdtemp(prefix="zero_ray-")
        self.control_token_file: str = str(write_token_file(os.path.join(token_dir, f"{self._credentials.job_id}.token"),
                                                            self._credentials))
        info = self._pool.info[0]
        self.num_params: int = info["numel"]
        log.info("zero_ray: stage %d, %d owners on %s/%s, %d parameters", cfg.stage, cfg.world_size, device, backend,
                 self.num_params)
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
        """The ``run_id`` tag on this run's Ray metrics (also its control-plane job id)."""
        return self._credentials.job_id

    @property
    def state(self) -> TrainerState:
        return self._state

    @property
    def stop_requested(self) -> bool:
        """An operator asked the run to stop (``zero-ray stop``); the loop should end."""
        return self.stop_reason is not None

    def request_stop(self, reason: str) -> str:
        """Ask the run to stop after the step in flight; returns the state afterwards."""
        with self._lock:
            self.stop_reason = reason or "stop requested"
            if self._state in (TrainerState.READY, TrainerState.STEPPING):
                self._state = TrainerState.STOPPING
            return self._state.value

    def job_status(self) -> JobStatus:
        """A snapshot for the Coordinator's Status call (thread-safe)."""
        health = self._pool.health.snapshot() if self._pool.health else []
        stats = self._pool.stats(timeout_s=2.0)
        ranks = []
        for r, node in enumerate(self._pool.nodes):
            hr = health[r] if r < len(health) else None
            st = stats[r] if r < len(stats) else None
            ranks.append(RankStatus(rank=r, node=f"{node.get('ip')} pid {node.get('pid')}",
                                    healthy=hr.healthy if hr else False,
                                    state=(hr.state if hr and hr.healthy else f"lost: {hr.lost_reason}") if hr else "?",
                                    last_heartbeat=hr.last_beat if hr else 0.0,
                                    memory=dict(st.memory_bytes) if st else {}))
        return JobStatus(world_size=self.world_size, stage=self.config.stage, step=self.step_count,
                         last_loss=float(self.last_metrics.get("loss", float("nan"))), state=self._state.value,
                         ranks=tuple(ranks))

    @property
    def world_size(self) -> int:
        return len(self._pool.actors)

    @property
    def actors(self) -> list[Any]:
        """The partition owners' Ray actor handles, in rank order."""
        return list(self._pool.actors)

    def _require_ready(self) -> None:
        if self._state is TrainerState.STOPPING:
            raise StopRequested(f"the run was asked to stop: {self.stop_reason}")
        if self._state is not TrainerState.READY:
            raise ZeroRayError(f"the trainer is {self._state.value}; create a new ZeroTrainer")

    # -- training ---------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer step on the global ``batch`` (split along dim 0 across the owners).

        Returns metrics: ``loss`` (mean over the global batch, before the update), ``grad_norm``
        (before clipping), ``lr``, ``skipped`` (fp16 overflow), ``loss_scale``, ``samples``,
        ``step_seconds``.
        """
        with self._step_mutex:
            return self._step(batch)

    def _step(self, batch: Batch) -> dict[str, Any]:
        self._require_ready()
        cfg = self.config
        n = batch_size(batch)
        world = self.world_size
        if n < world * cfg.grad_accum_steps:
            raise ConfigError(f"global batch of {n} samples is smaller than world_size * grad_accum_steps = "
                              f"{world} * {cfg.grad_accum_steps}; every rank needs at least one sample "
                              "per micro-batch")
        lr = self.optimizer.lr * float(self._schedule(self.step_count))
        start = time.perf_counter()
        pieces = [ray.put(p) for p in split_batch(batch, split_sizes(n, world))]
        args = [StepArgs(step=self.step_count, lr=lr, batch_ref=cloudpickle.dumps(ref), global_samples=n,
                         generation=self._pool.generation) for ref in pieces]
        with self._lock:
            self._state = TrainerState.STEPPING
        try:
            results = self._pool.step(args, timeout_s=cfg.step_timeout_s)
        except ZeroRayError as err:
            self._recover(err)
            raise
        finally:
            _unpin(pieces)
        with self._lock:
            if self._state is TrainerState.STEPPING:
                self._state = TrainerState.READY
        self.step_count += 1
        self.samples_seen += n
        loss = sum(r.loss_sum for r in results) / n
        metrics = {
            "step": self.step_count,
            "loss": loss,
            "grad_norm": results[0].grad_norm,
            "lr": lr,
            "skipped": results[0].skipped,
            "loss_scale": results[0].loss_scale,
            "samples": n,
            "step_seconds": time.perf_counter() - start,
            "owner_compute_seconds": max(r.compute_seconds for r in results),
            "bytes_sent": sum(sum(r.bytes_sent.values()) for r in results),
        }
        self.last_metrics = metrics
        self._run_metrics.record_step(metrics, results)
        self._coordinator.publish(MetricsEvent(step=self.step_count, loss=loss, step_seconds=metrics["step_seconds"],
                                               tokens_per_second=0.0, values={"grad_norm": metrics["grad_norm"],
                                                                               "lr": lr}))
        return metrics

    def _recover(self, err: ZeroRayError) -> None:
        """Carry out the failure policy's decision after a failed step: abort the survivors'
        collectives and re-form the group, or mark the run failed."""
        with self._lock:
            self._state = TrainerState.RECOVERING
        self._failures += 1
        lost = self._pool.health.lost() if self._pool.health else {}
        decision = self._policy.after_step_failure(lost_ranks=set(lost), failures_so_far=self._failures)
        log.warning("step %d failed (%s); %s: %s", self.step_count + 1, err, decision.action.value, decision.reason)
        if lost:
            self._pool.kill(sorted(lost))  # a frozen process holds its sockets open: end it first
        self._pool.abort(f"step {self.step_count + 1} failed: {err}")
        if decision.action is Action.REFORM:
            try:
                consistent = self._pool.reform()
            except ZeroRayError as reform_err:
                log.error("re-forming the group failed: %s", reform_err)
                consistent = False
            decision = self._policy.after_reform(consistent=consistent)
        with self._lock:
            self._state = TrainerState.READY if decision.action is Action.REFORM else TrainerState.FAILED

    # -- reports and consolidation ------------------------------------------------------------------
    def _require_alive(self) -> None:
        if self._state in (TrainerState.FAILED, TrainerState.SHUT_DOWN):
            raise ZeroRayError(f"the trainer is {self._state.value}")

    def memory_report(self) -> list[dict[str, int]]:
        """Per rank, model-state bytes held by category (measured from the tensors)."""
        self._require_alive()
        reports = self._pool.call("memory_report", timeout_s=self.config.init_timeout_s)
        self._run_metrics.record_memory(reports)
        return reports

    def comm_report(self) -> list[dict[str, int]]:
        """Per rank, bytes sent in the last step by collective."""
        self._require_alive()
        return self._pool.call("comm_report", timeout_s=self.config.init_timeout_s)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 parameters as ``{name: CPU tensor}``, names and shapes as in
        ``model_fn().named_parameters()``. This is the explicit consolidation: the whole model
        passes through the driver."""
        self._require_alive()
        shapes: dict[str, list[int]] = self._pool.info[0]["shapes"]
        out = {name: torch.empty(math.prod(shape), dtype=torch.float32) for name, shape in shapes.items()}
        # Stage 0 owners each hold all of a parameter; sharded owners a range of it.
        for fragments in self._pool.call("master_fragments", timeout_s=self.config.init_timeout_s):
            for name, (lo, hi, values) in fragments.items():
                out[name][lo:hi] = values
        return {name: out[name].view(shape) for name, shape in shapes.items()}

    # -- elasticity -------------------------------------------------------------------------------------
    def resize(self, world_size: int) -> dict[str, Any]:
        """Continue with ``world_size`` partition owners, live: new owners start (or surplus ones
        stop) and every partition range whose owner changes moves directly between actors
        through collectives; nothing goes through storage or the driver. The global batch stays
        as it is (each rank's share changes), so training continues as the uninterrupted run.
        Returns the sizes, bytes sent and seconds taken."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
        with self._step_mutex:
            self._require_ready()
            if world_size == self.world_size:
                return {"previous_world_size": world_size, "world_size": world_size, "bytes_sent": 0, "seconds": 0.0}
            self._checkpointer.wait(raise_error=False)  # a save in flight reads the current owners
            with self._lock:
                self._state = TrainerState.RESIZING
            try:
                report = self._pool.resize(world_size)
            except ResourceError:  # refused before any owner changed: the run goes on as it was
                with self._lock:
                    self._state = TrainerState.READY
                raise
            except BaseException as err:
                with self._lock:
                    self._state = TrainerState.FAILED
                log.error("resize to %d owners failed: %s", world_size, err)
                raise
            with self._lock:
                self._state = TrainerState.READY
        self.events.append(f"step {self.step_count}: resized {report['previous_world_size']} -> {world_size} owners "
                           f"({report['bytes_sent']} bytes moved in {report['seconds']:.2f}s)")
        log.info(self.events[-1])
        return report

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str] | None = None, *, wait: bool = False) -> str:
        """Save a sharded checkpoint under the root ``path`` (default ``config.checkpoint.dir``)
        and return its directory (``path/step-NNNNNNNN``).

        Training stalls only while every owner copies its slices to host memory; the files are
        written in the background and the checkpoint is committed (manifest, rename, ``latest``)
        once every rank's file is durable. ``wait=True`` (or ``wait_for_checkpoint()``) blocks
        until then. A crash before the commit leaves the previous checkpoint the latest.
        """
        root = path if path is not None else self.config.checkpoint.dir
        if root is None:
            raise ConfigError("save_checkpoint() needs a path, or ZeroConfig(checkpoint=CheckpointConfig(dir=...))")
        return self._save(os.fspath(root), wait=wait)[0]

    def checkpoint_now(self, path: str | None) -> tuple[str, int]:
        """The Coordinator's Checkpoint call: save after the step in flight; (directory, step)."""
        root = path or self.config.checkpoint.dir
        if root is None:
            raise ConfigError("this job has no checkpoint directory: pass a path (zero-ray checkpoint now PATH) or "
                              "start it with ZeroConfig(checkpoint=CheckpointConfig(dir=...))")
        return self._save(os.fspath(root), wait=False)

    def _save(self, root: str, *, wait: bool) -> tuple[str, int]:
        with self._step_mutex:
            self._require_ready()
            cfg = self.config
            position = RunPosition(step=self.step_count, samples_seen=self.samples_seen, world_size=self.world_size,
                                   stage=cfg.stage, compute_dtype=cfg.dtype, seed=cfg.seed,
                                   optimizer=optimizer_record(self.optimizer))
            target = self._checkpointer.save(root, position)
        if wait:
            self.wait_for_checkpoint()
        return target, position.step

    def wait_for_checkpoint(self, timeout_s: float | None = None) -> str | None:
        """Block until the save in flight is committed; returns the newest committed directory.
        Raises CheckpointError if that save was abandoned (the previous one stays latest)."""
        return self._checkpointer.wait(timeout_s=timeout_s)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], model_fn: ModelFn, loss_fn: LossFn, *,
                        optimizer: Optimizer | None = None, config: ZeroConfig | None = None) -> ZeroTrainer:
        """Resume from a checkpoint (a checkpoint directory, or a root whose ``latest`` is used) at
        any stage and world size: each owner reads only the ranges its new partition needs.

        ``optimizer`` defaults to the checkpoint's (type and hyperparameters); ``config`` to
        stage and world size as saved. ``step_count`` and ``samples_seen`` continue from the
        checkpoint: feed the batches from there on to continue as the uninterrupted run.
        """
        reader = CheckpointReader(os.fspath(path))  # the manifest only: checked before owners start
        m = reader.manifest
        reader.check_files()
        if config is None:
            config = ZeroConfig(stage=m.stage, world_size=m.world_size, dtype=m.compute_dtype, seed=m.seed)
        opt = optimizer if optimizer is not None else optimizer_from_record(dict(m.optimizer))
        trainer = cls(model_fn, loss_fn, optimizer=opt, config=config)
        try:
            trainer.load_checkpoint(reader.path)
        except BaseException:
            trainer.shutdown()
            raise
        return trainer

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Overwrite this run's model state, optimizer state and position with a checkpoint (a
        directory, or a root's ``latest``) saved at any stage and world size; returns the step it
        continues from. The manifest and file sizes are checked first, and each rank reads and
        verifies all its ranges before changing anything; if a rank still fails (a corrupt block)
        others may have loaded, so the trainer is then marked failed."""
        with self._step_mutex:
            self._require_ready()
            reader = CheckpointReader(os.fspath(path))
            m = reader.manifest
            reader.check_files()
            try:
                self._pool.load(reader.path, timeout_s=self.config.checkpoint.timeout_s)
            except BaseException:
                with self._lock:
                    self._state = TrainerState.FAILED
                raise
            self.step_count, self.samples_seen = m.step, m.samples_seen
        log.info("loaded %s: step %d (saved at stage %d x %d, now stage %d x %d)", reader.path, m.step, m.stage,
                 m.world_size, self.config.stage, self.world_size)
        return m.step

    def shutdown(self) -> None:
        """Stop the owners and the control server (after a save in flight commits). Idempotent."""
        if self._state is TrainerState.SHUT_DOWN:
            return
        try:
            self._checkpointer.wait(raise_error=False)
        except ZeroRayError as err:
            log.error("shutting down with a checkpoint still being written: %s", err)
        self._server.stop(grace_s=0.5)
        self._pool.shutdown()
        self._state = TrainerState.SHUT_DOWN
        try:
            os.unlink(self.control_token_file)
        except OSError:
            pass

    def __enter__(self) -> ZeroTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
