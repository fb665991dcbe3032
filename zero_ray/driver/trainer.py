"""ZeroTrainer: what users call. It starts the partition owners, splits each global batch
among them through Ray's object store, and combines their replies into a step's metrics."""

from __future__ import annotations

import enum
import math
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from zero_ray.config import ZeroConfig
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.core.optim import AdamW, Optimizer
from zero_ray.core.precision import parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.driver.pool import OwnerPool, PoolSpec
from zero_ray.errors import ConfigError, ZeroRayError
from zero_ray.owner.engine import EngineSpec, LossFn, ModelFn, StepResult

log = logging.getLogger(__name__)


class TrainerState(enum.Enum):
    READY = "ready"
    FAILED = "failed"  # a step failed part-way: the owners' state is no longer consistent
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
                            max_grad_norm=cfg.max_grad_norm, loss_scale=cfg.loss_scale)
        pool = PoolSpec(world_size=cfg.world_size, use_gpu=device == "cuda", num_cpus_per_owner=cfg.num_cpus_per_owner,
                        backend=backend, placement_strategy=cfg.placement_strategy,
                        collective_timeout_s=cfg.collective_timeout_s, init_timeout_s=cfg.init_timeout_s)
        self._pool = OwnerPool(pool, engine)
        self._state = TrainerState.READY
        self.step_count = 0
        self.last_metrics: dict[str, Any] = {}
        info = self._pool.info[0]
        self.num_params: int = info["numel"]
        log.info("zero_ray: stage %d, %d owners on %s/%s, %d parameters", cfg.stage, cfg.world_size, device, backend,
                 self.num_params)

    # -- properties for operators ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._pool.actors)

    @property
    def actors(self) -> list[Any]:
        """The partition owners' Ray actor handles, in rank order."""
        return list(self._pool.actors)

    def _require_ready(self) -> None:
        if self._state is not TrainerState.READY:
            raise ZeroRayError(f"the trainer is {self._state.value}; create a new ZeroTrainer")

    # -- training ---------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer step on the global ``batch`` (split along dim 0 across the owners).

        Returns metrics: ``loss`` (mean over the global batch, before the update), ``grad_norm``
        (before clipping), ``lr``, ``skipped`` (fp16 overflow), ``loss_scale``, ``samples``,
        ``step_seconds``.
        """
        self._require_ready()
        cfg = self.config
        n = batch_size(batch)
        if n < cfg.world_size * cfg.grad_accum_steps:
            raise ConfigError(f"global batch of {n} samples is smaller than world_size * grad_accum_steps = "
                              f"{cfg.world_size} * {cfg.grad_accum_steps}; every rank needs at least one sample "
                              "per micro-batch")
        lr = self.optimizer.lr * float(self._schedule(self.step_count))
        start = time.perf_counter()
        pieces = [ray.put(p) for p in split_batch(batch, split_sizes(n, cfg.world_size))]
        try:
            results: list[StepResult] = self._pool.call(
                "step", timeout_s=cfg.step_timeout_s, per_rank=[(ref, lr, n) for ref in pieces])
        except BaseException:
            self._state = TrainerState.FAILED
            raise
        self.step_count += 1
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
            "owner_step_seconds": max(r.step_seconds for r in results),
            "bytes_sent": sum(sum(r.bytes_sent.values()) for r in results),
        }
        self.last_metrics = metrics
        return metrics

    # -- reports and consolidation ------------------------------------------------------------------
    def memory_report(self) -> list[dict[str, int]]:
        """Per rank, model-state bytes held by category (measured from the tensors)."""
        self._require_ready()
        return self._pool.call("memory_report", timeout_s=self.config.init_timeout_s)

    def comm_report(self) -> list[dict[str, int]]:
        """Per rank, bytes sent in the last step by collective."""
        self._require_ready()
        return self._pool.call("comm_report", timeout_s=self.config.init_timeout_s)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 parameters as ``{name: CPU tensor}``, names and shapes as in
        ``model_fn().named_parameters()``. This is the explicit consolidation: the whole model
        passes through the driver."""
        self._require_ready()
        shapes: dict[str, list[int]] = self._pool.info[0]["shapes"]
        out = {name: torch.empty(math.prod(shape), dtype=torch.float32) for name, shape in shapes.items()}
        # Stage 0 owners each hold all of a parameter; sharded owners a range of it.
        for fragments in self._pool.call("master_fragments", timeout_s=self.config.init_timeout_s):
            for name, (lo, hi, values) in fragments.items():
                out[name][lo:hi] = values
        return {name: out[name].view(shape) for name, shape in shapes.items()}

    def shutdown(self) -> None:
        """Stop the owners. Idempotent."""
        if self._state is TrainerState.SHUT_DOWN:
            return
        self._pool.shutdown()
        self._state = TrainerState.SHUT_DOWN

    def __enter__(self) -> ZeroTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
