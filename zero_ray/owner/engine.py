"""OwnerEngine: one rank's training step (no Ray here; the actor wraps it).

A step: split this rank's piece of the global batch into micro-batches; forward and backward
each with its loss weighted by ``samples / global_samples`` (so the sum over all ranks and
micro-batches is exactly the global-mean gradient, uneven splits included); let the model state
combine gradients; unscale and check for overflow, clip by the global norm, update this rank's
slice, and all-gather updated parameters when the plan says so.

What a rank holds, and so how gradients are combined and parameters reach the module, is a
``ModelState``: ``ReplicatedParams`` (stages 0-2, every rank holds all parameters) or
``PartitionedParams`` (stage 3, ``zero_ray.owner.units``), chosen in ``make_model_state`` from
the plan's parameter residency and nowhere else.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zero_ray.collective.group import Collective
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes, to_device
from zero_ray.core.layout import Bucket, FlatLayout
from zero_ray.core.optim import Optimizer
from zero_ray.core.precision import LossScaleConfig, LossScaler
from zero_ray.config import Stage3Config
from zero_ray.core.stages import Residency, StagePlan
from zero_ray.errors import ConfigError, ModelError
from zero_ray.owner.reducer import GradReducer, make_reducer
from zero_ray.owner.shard import BucketState, ShardState


class StepPhase(enum.Enum):
    """Where a rank is in its step; an interrupted step is safe to discard until UPDATING."""

    IDLE = "idle"
    COMPUTING = "computing"  # forward, backward and gradient reduction: weights untouched
    UPDATING = "updating"  # the optimizer is changing weights / gathering updated parameters


ModelFn = Callable[[], torch.nn.Module]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What every rank needs to build the same model state."""

    model_fn: ModelFn
    loss_fn: LossFn
    optimizer: Optimizer
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


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One rank's share of a step's metrics."""

    rank: int
    loss_sum: float  # sum over this rank's samples of the per-sample mean loss
    samples: int
    grad_norm: float
    skipped: bool
    loss_scale: float
    compute_seconds: float
    step_seconds: float
    bytes_sent: dict[str, int]


def build_module(spec: EngineSpec) -> torch.nn.Module:
    """``torch.manual_seed(seed); model_fn()``, as the single-process reference builds it."""
    torch.manual_seed(spec.seed)
    return check_module(spec.model_fn())


def check_module(module: object) -> torch.nn.Module:
    """``module`` if zero_ray can train it (a module with floating-point trainable parameters)."""
    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"model_fn must return a torch.nn.Module; it returned {type(module).__name__}")
    bad = [(n, p.dtype) for n, p in module.named_parameters() if not p.dtype.is_floating_point]
    if bad:
        raise ModelError(f"parameters must be floating point to be trained; found {bad}")
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise ModelError(f"parameters with requires_grad=False are not supported yet: {frozen}; "
                         "remove them from the module or make them buffers")
    if not any(True for _ in module.parameters()):
        raise ModelError("model_fn returned a module without parameters")
    return module


def load_weights(module: torch.nn.Module, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
    """Overwrite ``module``'s parameters (and buffers the source has) with ``source``'s values,
    checked by name and shape the way stage 3 reads them."""
    from zero_ray.owner.units import StateDictSource, describe_modules  # units imports this module

    _, _, names = describe_modules(module)
    params = list(module.parameters())
    values = StateDictSource(source, names=names, shapes=[tuple(p.shape) for p in params])
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(values.fragment(i, 0, p.numel()).view(p.shape))
        for name, buf in module.named_buffers():
            value = values.buffer(name)
            if value is not None:
                buf.copy_(value)


def param_specs(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in module.named_parameters()]


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers (norm statistics, masks) take the compute dtype."""
    for buf in module.buffers():
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


@dataclass(frozen=True, kw_only=True)
class OptimizerSlice:
    """One flat range this rank updates: ``[start, end)`` of ``bucket``, its fp32 master
    weights and optimizer moments (views of the live tensors). Checkpoints save and restore
    through these, whatever the stage."""

    bucket: Bucket
    start: int
    end: int
    master: torch.Tensor
    moments: dict[str, torch.Tensor]


class ModelState(Protocol):
    """A rank's model state as the step drives it: its module, where gradients go, and the
    update of its slice. ``update_grads`` and ``apply_update`` pair up: one reduced gradient
    (compute dtype, over this rank's update slice) per optimizer slice, in the same order."""

    layout: FlatLayout
    module: torch.nn.Module

    def begin_micro_batch(self) -> None: ...

    def end_micro_batch(self, *, last: bool) -> None: ...

    def update_grads(self) -> list[torch.Tensor]: ...

    def apply_update(self, grads: list[torch.Tensor], *, step: int, lr: float) -> None: ...

    def end_step(self) -> None:
        """The update has used the step's gradients: release (or zero) them before the next."""
        ...

    def discard(self) -> None: ...

    def rebind(self, group: Collective) -> None: ...

    def memory_report(self) -> dict[str, int]: ...

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]: ...

    def optimizer_slices(self) -> list[OptimizerSlice]: ...

    def publish_masters(self) -> None:
        """Make the compute-dtype parameters agree with the masters after they were overwritten
        (a checkpoint restore): copy, and all-gather where the parameters are replicated."""
        ...


class ReplicatedParams:
    """Stages 0-2: every rank holds every parameter in flat buckets (``ShardState``); a
    ``GradReducer`` combines gradients; updated slices are all-gathered when the plan says so."""

    def __init__(self, spec: EngineSpec, *, rank: int, group: Collective, device: torch.device) -> None:
        self.spec = spec
        self.group = group
        module = build_module(spec)
        if spec.init_state_dict is not None:
            load_weights(module, spec.init_state_dict)
        element = torch.finfo(spec.compute_dtype).bits // 8
        self.layout = FlatLayout.by_size(param_specs(module), world_size=group.world_size,
                                         bucket_numel=max(1, spec.bucket_bytes // element))
        module.to(device)
        cast_buffers(module, spec.compute_dtype)
        self.module = module
        self.shard = ShardState.bind(module, layout=self.layout, plan=spec.plan, rank=rank,
                                     compute_dtype=spec.compute_dtype, device=device, optimizer=spec.optimizer)
        self.reducer: GradReducer = make_reducer(self.shard, group, micro_batches=self.spec.grad_accum_steps)
        self._in_step: dict[str, int] | None = None

    def begin_micro_batch(self) -> None:
        self.shard.acquire_grads()
        self.reducer.begin_micro_batch()

    def end_micro_batch(self, *, last: bool) -> None:
        self.reducer.end_micro_batch(last=last)

    def update_grads(self) -> list[torch.Tensor]:
        # The step's peak of model state: every gradient reduced, none released yet. The
        # tensors' sizes are fixed by the layout, so the first step's count holds for every step.
        if self._in_step is None:
            self._in_step = self.shard.memory_report()
        return [self.shard.update_grad(b) for b in self.shard.buckets]

    def apply_update(self, grads: list[torch.Tensor], *, step: int, lr: float) -> None:
        for b, g in zip(self.shard.buckets, grads):
            self.spec.optimizer.update(b.master, g, b.state, step=step, lr=lr, decay=b.decay)
            self._publish(b)

    def _publish(self, b: BucketState) -> None:
        if not b.master_is_view:
            b.params[b.update_start:b.update_end].copy_(b.master)
        if self.shard.plan.gather_after_update:
            self.group.all_gather_(b.params)

    def publish_masters(self) -> None:
        for b in self.shard.buckets:
            self._publish(b)

    def optimizer_slices(self) -> list[OptimizerSlice]:
        return [OptimizerSlice(bucket=b.spec, start=b.update_start, end=b.update_end, master=b.master, moments=b.state)
                for b in self.shard.buckets]

    def end_step(self) -> None:
        self.shard.release_grads()

    def discard(self) -> None:
        self.reducer.close()
        self.shard.release_grads()
        self.reducer = make_reducer(self.shard, self.group, micro_batches=self.spec.grad_accum_steps)

    def rebind(self, group: Collective) -> None:
        self.group = group
        self.reducer.close()
        self.reducer = make_reducer(self.shard, group, micro_batches=self.spec.grad_accum_steps)

    def memory_report(self) -> dict[str, int]:
        """Model state during a step, the paper's figure: counted at the last step's peak (every
        gradient reduced, none released) or, before any step, as allocated. Between steps the
        gradients are released (``grads_between_steps``)."""
        report = dict(self._in_step or self.shard.memory_report())
        report["grads_between_steps"] = 0  # released after every update
        report["staging_peak"] = self.reducer.peak_staging_bytes()
        return report

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self.shard.master_fragments()


def make_model_state(spec: EngineSpec, *, rank: int, group: Collective, device: torch.device) -> ModelState:
    """The one place a stage's model state is chosen: partitioned parameters (stage 3) gather
    units on demand; replicated ones live whole on every rank."""
    if spec.plan.parameters is Residency.SHARDED:
        from zero_ray.owner.units import PartitionedParams  # it imports this module

        return PartitionedParams(spec, rank=rank, group=group, device=device)
    return ReplicatedParams(spec, rank=rank, group=group, device=device)


class OwnerEngine:
    """One rank's model state and step."""

    def __init__(self, spec: EngineSpec, *, rank: int, group: Collective) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = group.world_size
        self.group = group
        self.device = torch.device(spec.device)
        self.state: ModelState = make_model_state(spec, rank=rank, group=group, device=self.device)
        self.layout = self.state.layout
        self.module = self.state.module
        self.scaler = LossScaler(config=spec.loss_scale, enabled=spec.compute_dtype == torch.float16)
        self.steps_done = 0
        self.last_bytes: dict[str, int] = {}
        self.phase = StepPhase.IDLE

    # -- the step -------------------------------------------------------------------------------
    def step(self, piece: Batch, *, lr: float, global_samples: int) -> StepResult:
        start = time.perf_counter()
        self.group.counters.reset()
        spec = self.spec
        samples = batch_size(piece)
        sizes = split_sizes(samples, spec.grad_accum_steps)
        if min(sizes) == 0:
            raise ConfigError(f"this rank's {samples} samples cannot fill {spec.grad_accum_steps=} micro-batches; "
                              "use a global batch of at least world_size * grad_accum_steps")
        scale = self.scaler.scale
        self.phase = StepPhase.COMPUTING
        loss_sum = 0.0
        compute = 0.0
        self.module.train()
        for i, micro in enumerate(split_batch(piece, sizes)):
            t0 = time.perf_counter()
            self.state.begin_micro_batch()
            loss = spec.loss_fn(self.module, to_device(micro, self.device, spec.compute_dtype))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ModelError(f"loss_fn must return a scalar tensor (the mean loss over the batch); got {shape}")
            weight = sizes[i] / global_samples
            (loss.reshape(()).float() * (weight * scale)).backward()
            compute += time.perf_counter() - t0
            self.state.end_micro_batch(last=i == len(sizes) - 1)
            loss_sum += float(loss.detach().float()) * sizes[i]
        norm, skipped = self._update(lr=lr, inv_scale=1.0 / scale)
        self.state.end_step()
        self.phase = StepPhase.IDLE
        self.last_bytes = self.group.counters.snapshot()
        return StepResult(rank=self.rank, loss_sum=loss_sum, samples=samples, grad_norm=norm, skipped=skipped,
                          loss_scale=scale, compute_seconds=compute, step_seconds=time.perf_counter() - start,
                          bytes_sent=self.last_bytes)

    def _update(self, *, lr: float, inv_scale: float) -> tuple[float, bool]:
        spec = self.spec
        fp32 = spec.compute_dtype == torch.float32
        grads: list[torch.Tensor] = []
        for g in self.state.update_grads():
            g = g if fp32 else g.float()
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            grads.append(g)
        # Each rank's update slice is either the whole buffer (replicated optimizer: every rank
        # already has the full reduced gradient) or its shard (the squares are summed across ranks).
        sq = sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads)
        if not spec.plan.updates_whole_buffer:
            sq = self.group.all_reduce_values([sq])[0]
        norm = math.sqrt(sq) if math.isfinite(sq) else math.inf
        if self.scaler.update(found_inf=not math.isfinite(norm)):
            return norm, True
        if spec.max_grad_norm is not None:
            coef = min(1.0, spec.max_grad_norm / (norm + 1e-6))
            for g in grads:
                g.mul_(coef)
        self.phase = StepPhase.UPDATING
        self.steps_done += 1
        self.state.apply_update(grads, step=self.steps_done, lr=lr)
        return norm, False

    # -- recovery ---------------------------------------------------------------------------------
    def discard_step(self) -> bool:
        """Forget an interrupted step. Returns whether the model state is still consistent
        (the step never reached its update), i.e. whether training may simply continue."""
        consistent = self.phase is not StepPhase.UPDATING
        self.state.discard()
        self.phase = StepPhase.IDLE
        return consistent

    def rebind(self, group: Collective) -> None:
        """Use a re-formed group (a new generation) from the next step on."""
        self.group = group
        self.state.rebind(group)

    # -- reports ----------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        report = {"rank": self.rank, **self.state.memory_report()}
        report["numel"] = self.layout.numel
        report["padded_numel"] = self.layout.padded_numel
        return report

    def comm_report(self) -> dict[str, int]:
        return {"rank": self.rank, **self.last_bytes, "total": sum(self.last_bytes.values())}

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self.state.master_fragments()
