"""Rank-side code of the PyTorch systems the benchmark drives itself.

A ``RankWorker`` actor is the same for every such system: it joins a ``torch.distributed``
gloo group (its own default group: every system gets fresh actors, so nothing leaks between
systems), then delegates building, stepping and reporting to a *recipe*, the part that differs
per system (single process, ZeroRedundancyOptimizer, FSDP2, DeepSpeed). Recipes are plain
classes instantiated inside the actor; they are passed by reference (module and name).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from benchmarks.harness.probe import (
    IN_STEP,
    HeldBytes,
    MemoryProbe,
    StateBytes,
    count_bytes,
    flatten_tensors,
    memory_probe,
    module_state_bytes,
    optimizer_state_tensors,
    reset_peak_rss,
)
from benchmarks.harness.workloads import Workload
from zero_ray.core.batching import Batch, batch_size
from zero_ray.core.optimizer_plan import AdamW
from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What every rank of a run is given."""

    workload: Workload
    optimizer: AdamW
    seed: int
    rank: int
    world_size: int
    options: dict[str, Any]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank} is outside 0..world_size-1 (world_size={self.world_size})")

    def build_module(self) -> torch.nn.Module:
        """``torch.manual_seed(seed); model_fn()``, as the single-process reference does."""
        torch.manual_seed(self.seed)
        return self.workload.model_fn()

    def loss_weight(self, samples: int, global_samples: int) -> float:
        # Every system here averages gradients over ranks; weighting each rank's mean loss by
        # world_size * samples / global_samples makes that average the global-batch mean even
        # when the batch does not split evenly (as DDPRun does).
        return self.world_size * samples / global_samples


def _weighted_step(ctx: RankContext, module: torch.nn.Module, opt: Any, piece: Batch, global_samples: int) -> float:
    """One plain-PyTorch optimizer step whose rank-averaged gradient is the global-batch mean;
    returns loss * samples for this rank."""
    opt.zero_grad()
    n = batch_size(piece)
    loss = ctx.workload.loss_fn(module, piece)
    (loss * ctx.loss_weight(n, global_samples)).backward()
    opt.step()
    return float(loss) * n


class Recipe(Protocol):
    """The per-system part of a rank. Constructed with no arguments inside the actor."""

    #: whether ranks must join a torch.distributed process group before ``build``
    needs_process_group: bool

    def build(self, ctx: RankContext) -> None: ...

    def step(self, piece: Batch, global_samples: int) -> float:
        """One optimizer step on this rank's piece; returns loss * samples (this rank)."""
        ...

    def state_bytes(self) -> StateBytes: ...

    def full_params(self) -> dict[str, torch.Tensor]:
        """The full fp32 parameters by name. Called on every rank at once (it may be a
        collective); only rank 0's answer is used."""
        ...

    def close(self) -> None: ...


class SingleRecipe:
    """One process, plain ``torch.optim``: the single-process system."""

    needs_process_group = False

    def build(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.module = ctx.build_module()
        self.opt = ctx.optimizer(self.module)

    def step(self, piece: Batch, global_samples: int) -> float:
        self.opt.zero_grad()
        loss = self.ctx.workload.loss_fn(self.module, piece)
        loss.backward()
        self.opt.step()
        return float(loss) * batch_size(piece)

    def state_bytes(self) -> StateBytes:
        return module_state_bytes(self.module, optimizer_state_tensors(self.opt))

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def close(self) -> None:
        pass


class TorchZeroRecipe:
    """DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping ``torch.optim.AdamW``
    (optimizer state sharded, ZeRO-1 style; gradients all-reduced by DDP, updated parameters
    broadcast by their owner)."""

    needs_process_group = True

    def build(self, ctx: RankContext) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.ctx = ctx
        self.module = DistributedDataParallel(ctx.build_module())
        inner = self.module.module
        # The same weight-decay groups as the AdamW factory builds for every other system.
        groups = ctx.optimizer(inner).param_groups
        cfg = ctx.optimizer
        self.opt = ZeroRedundancyOptimizer(
            [{"params": list(g["params"]), "weight_decay": g["weight_decay"]} for g in groups],
            optimizer_class=torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)

    def step(self, piece: Batch, global_samples: int) -> float:
        return _weighted_step(self.ctx, self.module, self.opt, piece, global_samples)

    def state_bytes(self) -> StateBytes:
        # The local optimizer holds state only for this rank's share of the parameters.
        return module_state_bytes(self.module.module, optimizer_state_tensors(self.opt.optim))

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.module.named_parameters()}

    def close(self) -> None:
        pass


class FSDP2Recipe:
    """``torch.distributed.fsdp.fully_shard`` (FSDP2) on a 1-D CPU device mesh over gloo: each
    ``workload.fsdp_units`` submodule is a unit, then the root; parameters, gradients and
    optimizer state are DTensor shards."""

    needs_process_group = True

    def build(self, ctx: RankContext) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.ctx = ctx
        module = ctx.build_module()
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        units = [m for m in module.modules() if type(m).__name__ in ctx.workload.fsdp_units]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
        self.module = module
        # Parameters are DTensors now, whose .shape is the global one, so the decay rule
        # (>= 2-D and not a bias) sees what it sees everywhere else.
        self.opt = ctx.optimizer(module)

    def step(self, piece: Batch, global_samples: int) -> float:
        return _weighted_step(self.ctx, self.module, self.opt, piece, global_samples)

    def state_bytes(self) -> StateBytes:
        return module_state_bytes(self.module, optimizer_state_tensors(self.opt))

    def full_params(self) -> dict[str, torch.Tensor]:
        # full_tensor() all-gathers: every rank must take part.
        out = {}
        for name, p in self.module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
        return out

    def close(self) -> None:
        pass


class DeepSpeedRecipe:
    """DeepSpeed ZeRO stage ``options["stage"]`` (1, 2 or 3) on the CPU accelerator, fp32,
    with ``torch.optim.AdamW`` as the client optimizer."""

    needs_process_group = True

    def build(self, ctx: RankContext) -> None:
        # The accelerator is chosen when deepspeed is first imported in this process.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        self.ctx = ctx
        stage = int(ctx.options["stage"])
        per_rank = ctx.workload.per_rank_batch
        module = ctx.build_module()
        opt = ctx.optimizer(module)
        config = {
            "train_batch_size": per_rank * ctx.world_size,
            "train_micro_batch_size_per_gpu": per_rank,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise
            # (GRADIENT_CLIPPING_DEFAULT in 0.19); no other system here clips, and clipping
            # changes Adam's steps (the GPT's parameters ended 1e-2 away from the reference).
            "gradient_clipping": 0.0,
            # torch.optim.AdamW is a client optimizer to DeepSpeed; it is what every other
            # system steps, so it is used here too rather than DeepSpeed's own Adam.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config,
                                                           dist_init_required=False)
        self._deepspeed = deepspeed

    def step(self, piece: Batch, global_samples: int) -> float:
        n = batch_size(piece)
        loss = self.ctx.workload.loss_fn(self.engine, piece)
        self.engine.backward(loss * self.ctx.loss_weight(n, global_samples))
        self.engine.step()
        return float(loss) * n

    def state_bytes(self) -> StateBytes:
        held = HeldBytes()
        zopt = self.opt
        params = list(self.engine.module.parameters())
        # ZeRO-3 leaves an empty .data on the module (small parameters excepted: DeepSpeed keeps
        # those whole, "persistent") and keeps the rank's partition in ds_tensor.
        p = count_bytes(params + [getattr(q, "ds_tensor", None) for q in params], held)
        base = getattr(zopt, "optimizer", zopt)  # the wrapped torch.optim.AdamW
        # fp32 partitions the wrapped AdamW steps: stage 1-2 keep them as separate copies even in
        # fp32 training; stage 3's may share memory with ds_tensor (then they count as params).
        masters = [getattr(zopt, "single_partition_of_fp32_groups", None),
                   getattr(zopt, "fp32_partitioned_groups_flat", None),
                   [q for g in base.param_groups for q in g["params"]]]
        grads = [[q.grad for q in params], [q.grad for q in flatten_tensors(masters)],
                 getattr(zopt, "grads_in_partition", None), getattr(zopt, "grad_partitions_flat_buffer", None),
                 getattr(zopt, "averaged_gradients", None)]
        g = count_bytes(grads, held)
        o = count_bytes([masters, optimizer_state_tensors(base)], held)
        return StateBytes(params=p, grads=g, optimizer=o)

    def full_params(self) -> dict[str, torch.Tensor]:
        named = list(self.engine.module.named_parameters())
        # A no-op for stages 1-2 (parameters are whole); an all-gather for stage 3.
        with self._deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {n: p.detach().clone().float() for n, p in named}

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)  # releases hooks and buffers (newer DeepSpeed)
        if callable(destroy):
            destroy()


class RankWorker:
    """One rank of a benchmark-driven PyTorch system (a Ray actor)."""

    def __init__(self, *, rank: int, world_size: int, threads: int = 1) -> None:
        torch.set_num_threads(max(1, threads))
        self.rank, self.world_size = rank, world_size
        self._recipe: Recipe | None = None
        self._pg_started = False

    def rendezvous(self) -> tuple[str, int]:
        """An address and a free port on this rank's node for the TCP store (rank 0)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, recipe_cls: type, ctx: RankContext, master: tuple[str, int] | None, timeout_s: float) -> None:
        recipe: Recipe = recipe_cls()
        if recipe.needs_process_group:
            import torch.distributed as dist

            if master is None:
                raise ConfigError(f"{recipe_cls.__name__} needs a process group but no rendezvous address was given")
            host, port = master
            # DeepSpeed reads these even when the group already exists; LOCAL_RANK only
            # picks a device index, which the CPU accelerator ignores.
            os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.rank),
                              LOCAL_WORLD_SIZE=str(self.world_size))
            dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))
            self._pg_started = True
        recipe.build(ctx)
        self._recipe = recipe

    @property
    def recipe(self) -> Recipe:
        if self._recipe is None:
            raise ConfigError(f"rank {self.rank}: setup() has not run")
        return self._recipe

    def step(self, piece: Batch, global_samples: int) -> tuple[float, float]:
        start = time.perf_counter()
        loss_sum = self.recipe.step(piece, global_samples)
        seconds = time.perf_counter() - start
        IN_STEP.step_done()
        return loss_sum, seconds

    def reset_peaks(self) -> bool:
        """Start the peak-RSS reading afresh and count model state inside the next step."""
        IN_STEP.arm(self.recipe.state_bytes)
        return reset_peak_rss()

    def report(self) -> tuple[MemoryProbe, StateBytes, StateBytes | None]:
        """Peak RSS, model state now (after a step) and inside a step."""
        return memory_probe(), self.recipe.state_bytes(), IN_STEP.state

    def full_params(self) -> dict[str, torch.Tensor] | None:
        params = self.recipe.full_params()
        return params if self.rank == 0 else None  # the others' copies would only cost transfer

    def close(self) -> None:
        if self._recipe is not None:
            self._recipe.close()
        if self._pg_started:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._pg_started = False
