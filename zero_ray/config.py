"""ZeroConfig: how a ZeroTrainer runs (frozen, keyword-only, validated on construction)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from zero_ray.core.precision import LossScaleConfig, parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Configuration of a ZeroTrainer.

    stage: 0 (plain data parallelism), 1 (optimizer state partitioned), 2 (+ gradients),
        3 (+ parameters).
    world_size: number of partition owners (Ray actors), one device each.
    device: "cpu", "cuda" or "auto" (CUDA when the cluster has world_size GPUs).
    backend: "gloo", "nccl" or "auto" (NCCL on CUDA, gloo on CPU).
    dtype: compute dtype, "float32" (default), "bfloat16" or "float16"; master weights and
        optimizer state are float32 whatever this is. float16 uses dynamic loss scaling.
    grad_accum_steps: micro-batches each rank's piece of the global batch is split into.
    max_grad_norm: clip the global gradient norm (across all partitions) to this, or None.
    seed: ``torch.manual_seed`` before ``model_fn()`` on every rank.
    bucket_bytes: size of the flat gradient/parameter buckets (constant-size fused buffers).
    lr_schedule: callable ``step -> multiplier`` of the optimizer's lr (see core.schedule).
    collective_timeout_s: every collective wait is bounded by this.
    step_timeout_s / init_timeout_s: bounds on the driver's waits for a step / for start-up.
    num_cpus_per_owner: logical CPUs each owner asks Ray for (CPU device), also its torch
        thread count.
    placement_strategy: Ray placement-group strategy for the owners.
    loss_scale: dynamic loss scaling settings (float16 only).
    health_interval_s / health_timeout_s: owners send heartbeats every interval over gRPC; one
        silent for the timeout (a frozen process) or whose stream breaks (a dead one) is lost.
    max_failures: step failures on live owners survived (abort, re-form the group, continue).
    control_token_dir: where the control token file is written (default: a private temp dir).
    """

    stage: int = 2
    world_size: int = 2
    device: str = "auto"
    backend: str = "auto"
    dtype: str = "float32"
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    seed: int = 0
    bucket_bytes: int = 25 * 2**20
    lr_schedule: Callable[[int], float] | None = None
    collective_timeout_s: float = 300.0
    step_timeout_s: float = 900.0
    init_timeout_s: float = 120.0
    num_cpus_per_owner: float = 1.0
    placement_strategy: str = "PACK"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    health_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    max_failures: int = 3
    control_token_dir: str | None = None

    def __post_init__(self) -> None:
        stage_plan(self.stage)  # raises ConfigError naming the stage
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size!r} must be an integer >= 1")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not one of {DEVICES}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError("backend='nccl' needs device='cuda'; use backend='gloo' on CPU")
        parse_dtype(self.dtype)
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps={self.grad_accum_steps!r} must be an integer >= 1")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number or None")
        if self.bucket_bytes < 1024:
            raise ConfigError(f"bucket_bytes={self.bucket_bytes} is too small; use at least 1024 (default 25 MiB)")
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise ConfigError(f"lr_schedule={self.lr_schedule!r} must be callable: step -> lr multiplier")
        if self.max_failures < 0:
            raise ConfigError(f"max_failures={self.max_failures!r} must be >= 0")
        if not self.health_interval_s < self.health_timeout_s:
            raise ConfigError(f"health_interval_s={self.health_interval_s!r} must be below "
                              f"health_timeout_s={self.health_timeout_s!r}")
        for name in ("collective_timeout_s", "step_timeout_s", "init_timeout_s", "health_interval_s",
                     "health_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value!r} must be a finite number of seconds > 0")
        if not self.num_cpus_per_owner > 0:
            raise ConfigError(f"num_cpus_per_owner={self.num_cpus_per_owner!r} must be > 0")
        if self.placement_strategy not in PLACEMENTS:
            raise ConfigError(f"placement_strategy={self.placement_strategy!r} is not one of {PLACEMENTS}")
