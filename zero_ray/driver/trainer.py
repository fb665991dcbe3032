"""ZeroTrainer: what users call. It starts the partition owners, splits each global batch
among them through Ray's object store, and combines their replies into a step's metrics."""

from __future__ import annotations

import enum
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
import torch

from zero_ray.config import ZeroConfig
from zero_ray.core.batching import Batch
from zero_ray.checkpoint.format import Manifest
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import export_pretrained
from zero_ray.core.optim import AdamW, Optimizer, optimizer_from_record, optimizer_record
from zero_ray.core.precision import parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.control.auth import Credentials, new_token, write_token_file
from zero_ray.control.handlers import EvaluateArgs, JobStatus, MetricsEvent, RankStatus, StepArgs, combine
from zero_ray.control.server import ServerConfig, serve_coordinator
from zero_ray.core.policy import FailurePolicy, ScalingPolicy
from zero_ray.driver.checkpointer import Checkpointer, RunPosition
from zero_ray.driver.coordinator import Coordinator
from zero_ray.driver.data import GlobalBatch, StagedBatch
from zero_ray.driver.fit import fit
from zero_ray.driver.recovery import Outcome, RecoveryController, RecoveryReport
from zero_ray.driver.metrics import RunMetrics
from zero_ray.driver.pool import OwnerPool, PoolSpec, _cluster_is_local
from zero_ray.errors import (
    CheckpointError,
    ConfigError,
    OwnerError,
    ResizeInterrupted,
    ResourceError,
    StopRequested,
    ZeroRayError,
)
from zero_ray.owner.spec import EngineSpec, LossFn, ModelFn

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
                        tls=cfg.control_tls,
                        snapshot_every=cfg.elastic.snapshot_every if cfg.elastic.redundancy == "peer" else 0)
        self._credentials = Credentials(job_id=uuid.uuid4().hex[:12], token=new_token())
        self._run_metrics = RunMetrics(run_id=self._credentials.job_id)
        self._scaling = ScalingPolicy(min_world_size=cfg.elastic.min_world_size,
                                      max_world_size=cfg.elastic.max_world_size)
        # Global batches of recent steps, by index, to replay after a restore (fit keeps indices only).
        self._replay: dict[int, GlobalBatch] = {}
        self._evaluations = 0  # staging keys of evaluate() calls
        self._last_grow_check = 0.0
        self.recoveries: list[RecoveryReport] = []
        self._lock = threading.Lock()
        # Held for a whole step and for a save's snapshot, so that an operator's checkpoint
        # (a gRPC thread) lands between steps on every rank alike.
        self._step_mutex = threading.RLock()
        self._state = TrainerState.READY
        self.step_count = 0  # steps completed in the owners' state
        self._submitted = 0  # steps the user has asked for (equal to step_count except during a replay)
        self._restored_at = 0.0
        self.samples_seen = 0
        self.last_metrics: dict[str, Any] = {}
        self.stop_reason: str | None = None
        self.events: list[str] = []  # membership changes and failure decisions, for operators
        # What checkpoints record beside the state (fit()'s data order), and what the checkpoint
        # this run resumed from recorded (checked by the next fit, then dropped).
        self.run_extra: dict[str, Any] = {}
        self.resumed: dict[str, Any] = {}
        self._pool = OwnerPool(pool, engine, credentials=self._credentials)
        self._checkpointer = Checkpointer(self._pool, keep=cfg.checkpoint.keep, timeout_s=cfg.checkpoint.timeout_s)
        self._recovery = RecoveryController(
            self._pool, failure=FailurePolicy(max_failures=cfg.max_failures, backoff_s=cfg.elastic.backoff_s),
            scaling=self._scaling, initial_world_size=cfg.world_size,
            peer_redundancy=cfg.elastic.redundancy == "peer", checkpoint_root=self._checkpoint_root)
        self._coordinator = Coordinator(self)
        host = "127.0.0.1" if _cluster_is_local() else ray.util.get_node_ip_address()
        self._server = serve_coordinator(self._coordinator, ServerConfig(host=host, credentials=self._credentials,
                                                                               **pool.server_tls()))
        token_dir = cfg.control_token_dir or tempfile.mkdtemp(prefix="zero_ray-")
        self.control_token_file: str = str(write_token_file(os.path.join(token_dir, f"{self._credentials.job_id}.token"),
                                                            self._credentials))
        info = self._pool.info[0]
        self.num_params: int = info["numel"]
        self.num_trainable_params: int = sum(math.prod(info["shapes"][n]) for n, t in info["trainable"].items() if t)
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
                         ranks=tuple(ranks), events=tuple(self.events[-20:]))

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

        Returns metrics: ``loss`` (mean over the global batch before the update: over items when
        ``loss_fn`` returns ``(loss_sum, count)``, else over samples), ``grad_norm`` (before
        clipping), ``lr``, ``skipped`` (fp16 overflow), ``loss_scale``, ``samples``, ``items``
        (the count, or tokens of an integer batch, or samples) and ``items_per_second``,
        ``step_seconds``.
        """
        with self._step_mutex:
            return self._step(StagedBatch(batch))

    def _step(self, work: GlobalBatch) -> dict[str, Any]:
        self._require_ready()
        cfg = self.config
        n = work.samples
        if n < self.world_size * cfg.grad_accum_steps:
            raise ConfigError(f"global batch of {n} samples is smaller than world_size * grad_accum_steps = "
                              f"{self.world_size} * {cfg.grad_accum_steps}; every rank needs at least one sample "
                              "per micro-batch")
        index = self._submitted  # the user's step: a restore may have rewound step_count below it
        self._replay[index] = work
        while len(self._replay) > cfg.elastic.max_replay_steps:
            del self._replay[min(self._replay)]
        start = time.perf_counter()
        while True:
            try:
                while self.step_count < index:  # a restore rewound the state: catch up first
                    self._execute(self._replay[self.step_count])
                lr, results = self._execute(work)
                break
            except ZeroRayError as err:
                if not self._recover(err, failed_step=self.step_count, replay_until=index + 1, started=start):
                    self._raise_failed(err)
                    raise
        self._submitted = index + 1
        if self.recoveries and self.recoveries[-1].replay_s < 0:  # this call recovered: time its replay
            self.recoveries[-1].replay_s = time.perf_counter() - self._restored_at
            self.events[-1] = self.recoveries[-1].summary()
        seconds = time.perf_counter() - start
        totals = combine([r.totals for r in results])
        metrics = {
            "step": self.step_count,
            "loss": totals["loss"],
            "grad_norm": results[0].grad_norm,
            "lr": lr,
            "skipped": results[0].skipped,
            "loss_scale": results[0].loss_scale,
            "samples": n,
            "items": totals["items"],
            "items_per_second": totals["items"] / seconds if seconds > 0 else 0.0,
            "step_seconds": seconds,
            "owner_compute_seconds": max(r.compute_seconds for r in results),
            "bytes_sent": sum(sum(r.bytes_sent.values()) for r in results),
        }
        if "count" in totals:
            metrics["count"] = totals["count"]
        self.last_metrics = metrics
        self._run_metrics.record_step(metrics, results)
        self._coordinator.publish(MetricsEvent(step=self.step_count, loss=metrics["loss"], step_seconds=seconds,
                                               tokens_per_second=metrics["items_per_second"],
                                               values={"grad_norm": metrics["grad_norm"], "lr": lr,
                                                       "items": metrics["items"]}))
        self._maybe_grow()
        return metrics

    def _execute(self, work: GlobalBatch) -> tuple[float, list[Any]]:
        """Run step ``step_count`` on ``work`` on every owner and count it."""
        n = work.samples
        lr = self.optimizer.lr * float(self._schedule(self.step_count))
        generation = self._pool.generation
        pieces, held = work.send(self._pool, world_size=self.world_size, key=f"{generation}:{self.step_count}")
        args = [StepArgs(step=self.step_count, lr=lr, piece=piece, global_samples=n, generation=generation)
                for piece in pieces]
        with self._lock:
            self._state = TrainerState.STEPPING
        results = self._pool.step(args, timeout_s=self.config.step_timeout_s)
        del held  # the owners are done with the staged pieces: the object store frees them
        with self._lock:
            if self._state is TrainerState.STEPPING:
                self._state = TrainerState.READY
        self.step_count += 1
        self.samples_seen += n
        return lr, results

    def evaluate(self, batch: Batch) -> dict[str, float]:
        """The loss on the global ``batch`` at the current parameters, forward only on every
        owner (module in eval mode, no gradients, nothing changes). Returns ``loss`` (the mean
        over items when ``loss_fn`` returns ``(loss_sum, count)``, else over samples),
        ``samples`` and ``items``, and ``count`` for the pair form."""
        with self._step_mutex:
            return self._evaluate(StagedBatch(batch))

    def fit(self, dataset: Any, *, global_batch_size: int, steps: int, seed: int = 0,
            collate_fn: Callable[[list[Any]], Any] | None = None, eval_dataset: Any = None,
            eval_every: int | None = None, checkpoint_every: int | None = None,
            progress: bool = True, callback: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Train until ``step_count`` reaches ``steps`` on a map-style ``dataset`` (``__len__`` and
        ``__getitem__``: a ``torch.utils.data.Dataset``, a Hugging Face ``datasets.Dataset``) or a
        zero-argument factory building one, which goes to every owner once; each owner builds
        its own piece of every global batch with ``collate_fn`` (default
        ``torch.utils.data.default_collate``). The step RPC carries indices only.

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
        return fit(self, dataset, global_batch_size=global_batch_size, steps=steps, seed=seed, collate_fn=collate_fn,
                   eval_dataset=eval_dataset, eval_every=eval_every, checkpoint_every=checkpoint_every,
                   progress=progress, callback=callback)

    def _evaluate(self, work: GlobalBatch) -> dict[str, float]:
        self._require_ready()
        if work.samples < self.world_size * self.config.grad_accum_steps:
            raise ConfigError(f"an evaluation batch of {work.samples} samples is smaller than world_size * "
                              f"grad_accum_steps = {self.world_size} * {self.config.grad_accum_steps}")
        while True:
            try:
                generation = self._pool.generation
                self._evaluations += 1
                pieces, held = work.send(self._pool, world_size=self.world_size,
                                         key=f"{generation}:eval{self._evaluations}")
                results = self._pool.evaluate([EvaluateArgs(piece=p, generation=generation) for p in pieces],
                                              timeout_s=self.config.step_timeout_s)
                del held
                return combine([r.totals for r in results])
            except ZeroRayError as err:  # an owner lost during evaluation: recover, then evaluate again
                if self._recover(err, failed_step=self.step_count, replay_until=self._submitted,
                                 started=time.perf_counter()):
                    while self.step_count < self._submitted:
                        self._execute(self._replay[self.step_count])
                elif self._state is TrainerState.FAILED:
                    self._raise_failed(err)
                    raise

    def _recover(self, err: ZeroRayError, *, failed_step: int, replay_until: int, started: float) -> bool:
        """Carry out the policies' decision after a failure in step ``failed_step`` (or between
        steps); True when the state was restored (``step_count`` rewound) and steps up to
        ``replay_until`` must be replayed from the kept batches. Every outcome is recorded."""
        with self._lock:
            self._state = TrainerState.RECOVERING
        before = self.step_count
        report = self._recovery.recover(err, failed_step=failed_step, step_started=time.time() - (
            time.perf_counter() - started), load_checkpoint=self._load_latest)
        restored = report.outcome is Outcome.RESTORED
        if restored:
            assert report.resume_step is not None
            missing = [i for i in range(report.resume_step, replay_until) if i not in self._replay]
            if missing:
                report.outcome, report.decision = Outcome.FAILED, "fail"
                report.reason = (f"the restored state is at step {report.resume_step} but the batches of steps "
                                 f"{missing[0] + 1}..{missing[-1] + 1} are no longer kept (elastic.max_replay_steps="
                                 f"{self.config.elastic.max_replay_steps}); resume with from_checkpoint")
                restored = False
            else:
                self.samples_seen -= sum(self._replay[i].samples for i in range(report.resume_step, before))
                self.step_count = report.resume_step
                report.replayed_steps = replay_until - report.resume_step
                report.replay_s = -1.0  # measured when the replay is done
                self._restored_at = time.perf_counter()
        self.recoveries.append(report)
        self.events.append(report.summary())
        log.warning("recovery: %s (%s)", report.summary(), report.reason)
        with self._lock:
            if report.outcome is Outcome.FAILED:
                self._state = TrainerState.FAILED
            else:
                self._state = TrainerState.READY
        return restored

    def _raise_failed(self, err: ZeroRayError) -> None:
        """After a failure the policies could not recover from: the same error, saying why the
        run ended (its own message first, so it still reads as what went wrong)."""
        if self._state is not TrainerState.FAILED or not self.recoveries:
            return
        report = self.recoveries[-1]
        text = (f"{err}\n\nThe run failed at step {report.failed_step + 1}: {report.reason}"
                + (f" ({'; '.join(report.notes)})" if report.notes else ""))
        try:
            if isinstance(err, OwnerError):
                new: ZeroRayError = type(err)(text, rank=err.rank)
            else:
                new = type(err)(text)
        except TypeError:  # an error type with another constructor: raise it as it is
            return
        raise new from err

    def _load_latest(self) -> int:
        root = self._checkpoint_root()
        if root is None:
            raise CheckpointError("no checkpoint has been committed for this run")
        return self._load_into_owners(root).step

    def _checkpoint_root(self) -> str | None:
        last = self._checkpointer.last_committed
        if last is not None:
            return os.path.dirname(last)
        return os.fspath(self.config.checkpoint.dir) if self.config.checkpoint.dir else None

    def _maybe_grow(self) -> None:
        """Grow back towards the starting size when the cluster has room again (checked at most
        every ``elastic.grow_check_s``: it asks Ray for its free resources)."""
        cfg = self.config.elastic
        if not cfg.grow_back or self.world_size >= self._scaling.ceiling(self.config.world_size):
            return
        now = time.monotonic()
        if now - self._last_grow_check < cfg.grow_check_s:
            return
        self._last_grow_check = now
        target = self._scaling.grow_to(current=self.world_size, free_slots=self._pool.free_slots(),
                                       initial=self.config.world_size)
        if target is not None:
            log.info("the cluster has room again: growing %d -> %d owners", self.world_size, target)
            try:
                self.resize(target)
            except ResourceError as err:  # the room went to someone else: try again later
                log.info("growing back deferred: %s", err)
            except ResizeInterrupted as err:
                log.warning("growing back was interrupted and recovered: %s", err)

    # -- reports and consolidation ------------------------------------------------------------------
    def _require_alive(self) -> None:
        if self._state in (TrainerState.FAILED, TrainerState.SHUT_DOWN):
            raise ZeroRayError(f"the trainer is {self._state.value}")

    def memory_report(self) -> list[dict[str, int]]:
        """Per rank, model-state bytes by category, measured from the tensors at the last step's
        peak (every gradient present: the paper's per-device figure). Stages 0-2 release their
        gradients after each update, so between steps a rank holds ``total`` less ``grads``
        (``grads_between_steps`` says what stays)."""
        self._require_alive()
        reports = self._pool.call("memory_report", timeout_s=self.config.init_timeout_s)
        self._run_metrics.record_memory(reports)
        return reports

    def comm_report(self) -> list[dict[str, int]]:
        """Per rank, bytes sent in the last step by collective."""
        self._require_alive()
        return self._pool.call("comm_report", timeout_s=self.config.init_timeout_s)

    def full_state_dict(self, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The fp32 parameters as ``{name: CPU tensor}``, names and shapes as in
        ``model_fn().named_parameters()``. This is the explicit consolidation: the whole model
        passes through the driver. ``trainable_only``: just the parameters with
        ``requires_grad=True`` (a PEFT adapter's weights, without the frozen base model)."""
        self._require_alive()
        info = self._pool.info[0]
        shapes: dict[str, list[int]] = {n: s for n, s in info["shapes"].items()
                                        if info["trainable"][n] or not trainable_only}
        out = {name: torch.empty(math.prod(shape), dtype=torch.float32) for name, shape in shapes.items()}
        # Stage 0 owners each hold all of a parameter; sharded owners a range of it.
        for fragments in self._pool.call("master_fragments", timeout_s=self.config.init_timeout_s):
            for name, (lo, hi, values) in fragments.items():
                if name in out:
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
            except ZeroRayError as err:
                log.error("resize to %d owners failed: %s", world_size, err)
                if not self._recover(err, failed_step=self.step_count, replay_until=self._submitted,
                                     started=time.perf_counter()):
                    self._raise_failed(err)
                    raise
                raise ResizeInterrupted(f"resizing to {world_size} owners failed ({err}); the run was restored "
                                        f"at {self.world_size} owners and continues with the next step") from err
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

    def _save(self, root: str, *, wait: bool, remember: bool = True) -> tuple[str, int]:
        with self._step_mutex:
            self._require_ready()
            cfg = self.config
            position = RunPosition(step=self.step_count, samples_seen=self.samples_seen, world_size=self.world_size,
                                   stage=cfg.stage, compute_dtype=cfg.dtype, seed=cfg.seed,
                                   optimizer=optimizer_record(self.optimizer), extra=dict(self.run_extra))
            target = self._checkpointer.save(root, position, remember=remember)
        if wait:
            self.wait_for_checkpoint()
        return target, position.step

    def export_pretrained(self, directory: str | os.PathLike[str], *, max_shard_size: str | int = "5GB",
                          dtype: str | None = None) -> list[str]:
        """Write the current weights into ``directory`` as Hugging Face ``save_pretrained``
        writes them (``model.safetensors``, or shards and ``model.safetensors.index.json`` above
        ``max_shard_size``); with the model's ``config.json`` there, ``from_pretrained`` loads it.
        Memory stays bounded: every owner writes its shard to a checkpoint under ``directory``
        (removed afterwards) and the files are streamed from it. Returns the files written."""
        target = os.fspath(directory)
        os.makedirs(target, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".zero_ray-export-", dir=target)
        try:
            saved = self._save(scratch, wait=True, remember=False)[0]
            return export_pretrained(saved, target, max_shard_size=max_shard_size, dtype=dtype)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

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
            try:
                m = self._load_into_owners(os.fspath(path))
            except BaseException:
                with self._lock:
                    self._state = TrainerState.FAILED
                raise
            self.step_count, self.samples_seen = m.step, m.samples_seen
            self._submitted = m.step
            self.run_extra, self.resumed = dict(m.extra), dict(m.extra)
        return m.step

    def _load_into_owners(self, path: str) -> Manifest:
        """Check the checkpoint at ``path`` (manifest, file sizes), then have every owner load
        its ranges; returns the manifest."""
        reader = CheckpointReader(path)
        m = reader.manifest
        reader.check_files()
        self._pool.load(reader.path, timeout_s=self.config.checkpoint.timeout_s)
        log.info("loaded %s: step %d (saved at stage %d x %d, now stage %d x %d)", reader.path, m.step, m.stage,
                 m.world_size, self.config.stage, self.world_size)
        return m

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
