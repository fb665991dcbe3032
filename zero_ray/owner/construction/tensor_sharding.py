"""A module split over a tensor-parallel group: the plan (``core/tensor_parallel_plan``) applied
to torch modules, Megatron-style, over the project's own ``Collective``.

Each linear layer the plan shards is replaced, in its parent, by a ``ShardedLinear`` holding
this rank's slice of the weight (and bias) under the same attribute names, so parameter names
do not change:

- colwise (Megatron's column-parallel layer): the weight's rows (output features) and the bias
  are split; forward is the identity on the input and backward sums the input's gradient over
  the group (Megatron's ``f``). Colwise layers under one parent (q/k/v of an attention, gate/up
  of an MLP) share one ``f`` per input tensor within the parent's forward (``SharedInput``), so
  their gradients are added locally and summed over the group once, as Megatron does.
- rowwise (row-parallel): the weight's columns (input features) are split; forward sums the
  partial outputs over the group and adds the whole bias once (``g``); backward is the identity.

Why modules over ``Collective`` and not ``torch.distributed.tensor``: docs/tensor_parallel.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zero_ray.collective.collective_api import Collective
from zero_ray.core.tensor_parallel_plan import (
    COLWISE,
    LINEAR,
    ModuleShard,
    ShardableModule,
    TensorParallel,
    TensorParallelPlan,
    choose_plan,
    resolve_plan,
)
from zero_ray.core.reshard_plan import Block
from zero_ray.owner.construction.group_ops import register_group, tp_all_reduce
from zero_ray.owner.construction.sequence_parallel import apply_sequence_parallel, reduce_scatter_output

# Attributes some attention modules keep their head counts in (older transformers read
# ``self.num_heads`` in forward's views); divided by T where a module holds them. Transformers
# 5.x's attention modules view with -1 heads and keep only head_dim and the query/key-value
# ratio, which sharding leaves unchanged.
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_key_value_heads")


class _CopyToGroup(torch.autograd.Function):
    """Megatron's ``f``: the identity forward; the input gradient summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int) -> torch.Tensor:
        ctx.handle = handle
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tp_all_reduce(grad, ctx.handle), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's ``g``: the partial outputs summed over the group; the identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int) -> torch.Tensor:
        return tp_all_reduce(x, handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SharedInput:
    """One ``f`` per input tensor for the colwise layers of one parent module: within the
    parent's forward (opened and closed by its forward hooks, so nothing outlives it, and a
    recomputation under checkpointing opens it again), the first layer to see a tensor wraps it
    and the others take the same wrapped tensor. Backward then adds their input gradients
    locally and all-reduces the sum once: q/k/v three sums become one, gate/up two one. The
    same on every TP rank (they run the same forward), so the collectives stay in step."""

    group: Collective
    handle: int  # the group's, for the custom op (group_ops)
    _open: list[tuple[torch.Tensor, torch.Tensor]] | None

    def __init__(self, group: Collective) -> None:
        self.group = group
        self.handle = register_group(group)
        self._open = None  # (input, its f) pairs of the parent's forward in progress; None outside

    def attach(self, parent: nn.Module) -> None:
        parent.register_forward_pre_hook(lambda module, args: self._begin())
        parent.register_forward_hook(lambda module, args, out: self._end(), always_call=True)

    def _begin(self) -> None:
        self._open = []

    def _end(self) -> None:
        self._open = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._open is None:  # called outside its parent's forward: an f of its own
            return _CopyToGroup.apply(x, self.handle)
        for seen, wrapped in self._open:  # by identity: tensors compare element-wise
            if seen is x:
                return wrapped
        wrapped = _CopyToGroup.apply(x, self.handle)
        self._open.append((x, wrapped))
        return wrapped


class ShardedLinear(nn.Linear):
    """This rank's slice of a linear layer (an ``nn.Linear`` still, for wrap policies and
    compilation). ``in_features`` / ``out_features`` are the local sizes; ``full_shape`` the
    whole weight's; ``shard_dim`` the weight dimension split (0 colwise, 1 rowwise)."""

    style: str
    shard_dim: int
    tp_rank: int
    tp_size: int
    full_shape: tuple[int, int]
    group: Collective
    handle: int  # the group's, for the custom op (group_ops): compiled forwards keep it in the graph
    shared: SharedInput | None  # colwise: the f it shares with its siblings (None: its own)
    sequence_parallel: bool  # its parent gathers the sequence (colwise: no f); rowwise reduce-scatters

    def __init__(self, source: nn.Linear, shard: ModuleShard, group: Collective,
                 shared: SharedInput | None = None, sequence_parallel: bool = False) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a whole weight
        self.shared, self.sequence_parallel = shared, sequence_parallel
        self.style, self.shard_dim = shard.style, shard.dim
        self.tp_rank, self.tp_size, self.group = group.rank, group.world_size, group
        self.handle = register_group(group)
        self.full_shape = (source.out_features, source.in_features)
        weight = source.weight.detach().chunk(self.tp_size, dim=shard.dim)[self.tp_rank]
        self.weight = nn.Parameter(weight.clone(), requires_grad=source.weight.requires_grad)
        self.out_features, self.in_features = self.weight.shape
        if source.bias is None:
            self.register_parameter("bias", None)
        else:
            # colwise splits the bias with the outputs; rowwise adds it whole after the sum
            bias = source.bias.detach()
            bias = bias.chunk(self.tp_size)[self.tp_rank] if shard.style == COLWISE else bias
            self.bias = nn.Parameter(bias.clone(), requires_grad=source.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == COLWISE:
            if self.sequence_parallel:  # the parent's sequence gather sums the input gradient
                return F.linear(x, self.weight, self.bias)
            copied = self.shared(x) if self.shared is not None else _CopyToGroup.apply(x, self.handle)
            return F.linear(copied, self.weight, self.bias)
        if self.sequence_parallel:
            out = reduce_scatter_output(F.linear(x, self.weight), self.handle, self.tp_rank, self.tp_size)
            return out if self.bias is None else out + self.bias
        out = _ReduceFromGroup.apply(F.linear(x, self.weight), self.handle)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, style={self.style}, rank={self.tp_rank}/{self.tp_size}"


def describe_modules(model: nn.Module) -> list[ShardableModule]:
    """Every module of ``model`` as the pure plan reads it; a projection whose parent keeps an
    integer ``head_dim`` (every Hugging Face attention module) carries it."""
    modules = dict(model.named_modules())
    out = []
    for name, module in modules.items():
        parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        head_dim = getattr(parent, "head_dim", None) if name else None
        head_dim = head_dim if isinstance(head_dim, int) and not isinstance(head_dim, bool) else None
        if isinstance(module, nn.Linear):
            out.append(ShardableModule(name=name, kind=LINEAR, in_features=module.in_features,
                                       out_features=module.out_features, has_bias=module.bias is not None,
                                       head_dim=head_dim))
        else:
            out.append(ShardableModule(name=name, kind=type(module).__name__))
    return out


def model_plan(model: nn.Module) -> tuple[Mapping[str, str] | None, str]:
    """A Hugging Face model's own plan (``config.base_model_tp_plan``) and the attribute its base
    model is under (``"model"`` in ``LlamaForCausalLM``; ``""`` for a base model itself)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not (isinstance(prefix, str) and prefix and isinstance(getattr(model, prefix, None), nn.Module)):
        prefix = ""
    return (dict(plan) if plan else None), prefix


def plan_model(model: nn.Module, tp: TensorParallel) -> TensorParallelPlan:
    """The plan ``tp`` resolves to on ``model`` (checked: ConfigError naming what T must divide,
    or ``plan=`` where the model has none); nothing is changed."""
    own, prefix = model_plan(model)
    pairs, prefix, source = choose_plan(user=tp.plan, model=own, size=tp.size, prefix=prefix)  # type: ignore[arg-type]
    return resolve_plan(describe_modules(model), pairs, size=tp.size, prefix=prefix, source=source)


def shard_model(model: nn.Module, tp: TensorParallel, group: Collective) -> TensorParallelPlan:
    """Split ``model`` in place over ``group`` (this rank's ``group.rank`` of ``tp.size``) as
    its plan says; the plan. Size 1 changes nothing."""
    if group.world_size != tp.size:
        raise ValueError(f"a tensor-parallel group of {group.world_size} ranks was given for size={tp.size}")
    if any(isinstance(m, ShardedLinear) for m in model.modules()):
        raise ValueError("the model is already sharded over a tensor-parallel group; shard a model once")
    plan = plan_model(model, tp)
    if tp.size == 1:
        return plan
    modules = dict(model.named_modules())
    colwise = Counter(s.name.rpartition(".")[0] for s in plan.shards if s.style == COLWISE)
    sp = tp.sequence_parallel
    shared: dict[str, SharedInput] = {}
    for name, count in colwise.items():
        if count > 1 and not sp:  # siblings that may read one input: one f between them
            shared[name] = SharedInput(group)
            shared[name].attach(modules[name])
    for shard in plan.shards:
        parent_name, _, child = shard.name.rpartition(".")
        parent = modules[parent_name]
        setattr(parent, child, ShardedLinear(modules[shard.name], shard, group, sequence_parallel=sp,
                                             shared=shared.get(parent_name) if shard.style == COLWISE else None))
    for name in {s.name.rpartition(".")[0] for s in plan.shards}:
        _divide_head_counts(modules[name], tp.size)
    if sp:
        sharded = [p for m in model.modules() if isinstance(m, ShardedLinear)
                   for p in ([m.weight] + ([m.bias] if m.bias is not None and m.style == COLWISE else []))]
        apply_sequence_parallel(model, group, colwise_parents=[modules[n] for n in colwise], sharded=sharded)
    return plan


def _divide_head_counts(module: nn.Module, size: int) -> None:
    for attr in HEAD_COUNT_ATTRIBUTES:
        value = module.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(module, attr, value // size)


def gather_along(group: Collective, local: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole tensor from every rank's equal slice ``local`` along ``dim`` (rank order)."""
    size = group.world_size
    buf = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    buf.view(size, -1)[group.rank].copy_(local.detach().reshape(-1))
    group.all_gather_(buf)
    parts = [chunk.view(local.shape) for chunk in buf.view(size, -1)]
    return torch.cat(parts, dim=dim)


def full_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (by parameter name: values or gradients of ``model``'s parameters) at their
    whole shapes: a ShardedLinear's slices gathered over its group, the rest as they are
    (replicated). Every rank of the group calls it with the same names, in the same order."""
    owners = {f"{name}.{p}": m for name, m in model.named_modules() if isinstance(m, ShardedLinear)
              for p in ("weight", "bias")}
    out = {}
    for name, value in tensors.items():
        module = owners.get(name)
        if module is None or (name.endswith(".bias") and module.style != COLWISE):
            out[name] = value.detach().clone()
        else:
            out[name] = gather_along(module.group, value, module.shard_dim if name.endswith(".weight") else 0)
    return out


def shard_blocks(model: nn.Module) -> dict[str, Block]:
    """Each TP-sharded parameter's slice of its whole tensor, by parameter name (a checkpoint
    addresses it so: checkpoint/format.py); a parameter not named is whole on every TP rank."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, ShardedLinear):
            continue
        prefix = f"{name}." if name else ""
        dim, rank = module.shard_dim, module.tp_rank
        full = module.full_shape
        part = full[dim] // module.tp_size
        out[prefix + "weight"] = Block(full=full, offsets=tuple(rank * part if d == dim else 0 for d in range(2)),
                                       extent=tuple(part if d == dim else n for d, n in enumerate(full)))
        if module.bias is not None and module.style == COLWISE:
            out[prefix + "bias"] = Block(full=(full[0],), offsets=(rank * part,), extent=(part,))
    return out


def join_shards(model: nn.Module, per_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every TP rank's (``per_rank[t]``: TP rank t's values by parameter name,
    at its local shapes) on one process: a ShardedLinear's slices joined along their dimension
    in rank order, a replicated tensor taken from rank 0. ``model`` is any rank's sharded module
    (consolidation and tests; ``full_tensors`` is the collective form)."""
    owners = {f"{name}.{p}": m for name, m in model.named_modules() if isinstance(m, ShardedLinear)
              for p in ("weight", "bias")}
    out = {}
    for name, value in per_rank[0].items():
        module = owners.get(name)
        if module is None or (name.endswith(".bias") and module.style != COLWISE):
            out[name] = value.detach().clone()
        else:
            dim = module.shard_dim if name.endswith(".weight") else 0
            out[name] = torch.cat([r[name].detach() for r in per_rank], dim=dim)
    return out
