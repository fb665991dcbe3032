"""EngineSpec: what every rank needs to build the same model state and run the same step."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zero_ray.config import ActivationCheckpointing, Compile, Stage3Config, ZeroConfig
from zero_ray.core.offload_options import Offload
from zero_ray.core.optimizer_plan import OptimizerFactory, SchedulerFactory
from zero_ray.core.precision import LossScaleConfig
from zero_ray.core.stages import StagePlan
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.topology import Topology

ModelFn = Callable[[], torch.nn.Module]
LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What a driver attaching to a detached run rebuilds itself from (``ZeroTrainer.attach``):
    every owner holds it and hands it over through Ray, as Python objects."""

    config: ZeroConfig  # the control plane's TLS settings among them, needed before speaking gRPC
    optimizer: OptimizerFactory | list[OptimizerFactory]
    lr_scheduler: SchedulerFactory | None
    detached: bool


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What every rank needs to build the same model state."""

    model_fn: ModelFn
    loss_fn: LossFn
    optimizers: tuple[OptimizerFactory, ...]  # each: module -> torch.optim.Optimizer
    plan: StagePlan
    compute_dtype: torch.dtype
    device: str
    seed: int
    bucket_bytes: int
    grad_accum_steps: int
    max_grad_norm: float | None
    loss_scale: LossScaleConfig
    stage3: Stage3Config = field(default_factory=Stage3Config)
    init_state_dict: str | os.PathLike[str] | Mapping[str, Any] | None = None  # fine-tuning start
    activation_checkpointing: ActivationCheckpointing | None = None
    compile: Compile | None = None  # torch.compile per unit (owner/construction/compiled.py)
    offload: Offload = field(default_factory=Offload)  # where the optimizer state lives (owner/tensors/state_files.py)
    lr_scheduler: SchedulerFactory | None = None  # optimizer -> LRScheduler, applied to each optimizer
    optimizer_kinds: tuple[tuple[str, str], ...] = ()  # declared classes: (qualified name, kind)
    reduce_dtype: torch.dtype | None = None  # of gradient reductions; None: the compute dtype
    on_nonfinite: str = "raise"  # ZeroConfig.on_nonfinite: a non-finite step is refused ("raise") or skipped
    topology: Topology = field(default_factory=Topology)  # groups and comm dtypes (default: flat)
    # T > 1: each TP group shards the module by its plan, ZeRO runs within each shard's DP group
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
