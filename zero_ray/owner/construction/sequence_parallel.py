"""Sequence parallelism (Megatron's; torch's ``SequenceParallel`` style) over a TP group: between
the colwise/rowwise pairs of the blocks, the norms, the residuals and the blocks' inputs hold
this rank's 1/T of the sequence (dimension 1) instead of all of it on every rank.

Where the layout changes (torchtitan's plan, as autograd functions over the project's
``Collective``):

- the first block's input is split (each rank keeps its chunk; backward all-gathers);
- each parent of colwise layers (an attention, an MLP) all-gathers its input before its forward
  (``PrepareModuleInput`` to Replicate: the parent views its input by the sequence length, so the
  gather is before it, not inside the colwise layer); backward reduce-scatters the input's
  gradient, which is the sum of every rank's colwise layers' (Megatron's ``f``, along the sequence);
- a rowwise layer reduce-scatters its partial outputs along the sequence (``g``; backward
  all-gathers), so the parent returns its chunk;
- the output head's input is all-gathered (backward: this rank's chunk of the replicated gradient).

A replicated parameter inside that region (a norm's weight, a rowwise bias) then sees only this
rank's tokens, so its gradient is summed over the TP group (a tensor hook, before accumulation)
and is again the same on every rank, as ZeRO and the global clipping expect.

Bytes go under ``tp_sequence`` (all-gathers and reduce-scatters) beside the rowwise layers'
and the norms' ``tp_all_reduce``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zero_ray.collective.collective_api import Collective
from zero_ray.errors import ConfigError
from zero_ray.owner.construction.group_ops import all_reduce_sum

OP = "sequence"  # counted as tp_sequence by the TP group


def _check(x: torch.Tensor, size: int) -> None:
    if x.dim() < 2 or x.shape[1] % size:
        raise ConfigError(f"sequence_parallel splits dimension 1 (the sequence) over the tensor_parallel size={size}, "
                          f"but a block's input has shape {tuple(x.shape)}; pad the sequences to a multiple of {size} "
                          "or set TensorParallel(sequence_parallel=False)")


def gather_sequence(group: Collective, local: torch.Tensor) -> torch.Tensor:
    """Every rank's chunk ``local`` (B, S/T, ...) joined along dimension 1 in rank order."""
    size = group.world_size
    buf = torch.empty((size, *local.shape), dtype=local.dtype, device=local.device)
    buf[group.rank].copy_(local)
    group.all_gather_(buf.view(-1), op=OP)
    return buf.transpose(0, 1).reshape(local.shape[0], size * local.shape[1], *local.shape[2:])


def reduce_scatter_sequence(group: Collective, full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk along dimension 1 of ``full`` (B, S, ...) summed over the group."""
    size = group.world_size
    _check(full, size)
    b, s = full.shape[0], full.shape[1]
    buf = full.reshape(b, size, s // size, *full.shape[2:]).transpose(0, 1).contiguous()
    out = group.reduce_scatter_(buf.view(-1), op=OP)
    return out.view(buf.shape[1:]).clone()  # a copy: a view would keep all T chunks alive


def chunk_sequence(group: Collective, full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk along dimension 1 (a copy, so the whole tensor can be freed: with one
    sequence in the batch the chunk is contiguous already, and a view would keep all of it)."""
    _check(full, group.world_size)
    return full.chunk(group.world_size, dim=1)[group.rank].clone(memory_format=torch.contiguous_format)


class _Split(torch.autograd.Function):
    """Region start: keep this rank's chunk; backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collective) -> torch.Tensor:
        ctx.group = group
        return chunk_sequence(group, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(ctx.group, grad.contiguous()), None


class _Gather(torch.autograd.Function):
    """A colwise parent's input: all-gather; backward reduce-scatters the partial gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collective) -> torch.Tensor:
        ctx.group = group
        return gather_sequence(group, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_sequence(ctx.group, grad), None


class _ReduceScatter(torch.autograd.Function):
    """A rowwise layer's partial outputs: reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collective) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_sequence(group, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_sequence(ctx.group, grad.contiguous()), None


class _GatherReplicated(torch.autograd.Function):
    """Region end (the head's input): all-gather; the gradient, the same on every rank, is cut."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Collective) -> torch.Tensor:
        ctx.group = group
        return gather_sequence(group, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return chunk_sequence(ctx.group, grad), None


def reduce_scatter_output(x: torch.Tensor, group: Collective) -> torch.Tensor:
    """A rowwise layer's output under sequence parallelism (``ShardedLinear``)."""
    return _ReduceScatter.apply(x, group)


def _first_input(apply: Any, group: Collective) -> Any:
    """A forward pre-hook (with kwargs) replacing the hidden state, the first positional
    argument or ``hidden_states`` / ``x``, by ``apply(it, group)``."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args and isinstance(args[0], torch.Tensor):
            return (apply(args[0], group), *args[1:]), kwargs
        for key in ("hidden_states", "x"):
            if isinstance(kwargs.get(key), torch.Tensor):
                return args, {**kwargs, key: apply(kwargs[key], group)}
        raise ConfigError(f"sequence_parallel found no hidden state in {type(module).__name__}'s inputs (the first "
                          "positional argument or hidden_states=); set TensorParallel(sequence_parallel=False)")

    return hook


def _sum_over(group: Collective) -> Any:
    return lambda grad: all_reduce_sum(group, grad)


def apply_sequence_parallel(model: nn.Module, group: Collective, *, colwise_parents: Iterable[nn.Module],
                            sharded: Iterable[nn.Parameter]) -> None:
    """Install the layout changes on ``model`` (already split by its plan): the blocks are the
    ModuleList holding the colwise parents; ``sharded``: the parameters the plan splits (every
    other trainable parameter between the first block and the head has its gradient summed)."""
    parents = list(colwise_parents)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    blocks = _blocks(model, parents)
    if head is None or embed is None or blocks is None:
        raise ConfigError(f"sequence_parallel needs a model with input embeddings, an output head and its blocks in "
                          f"one ModuleList (a Hugging Face ...ForCausalLM); {type(model).__name__} has "
                          f"{'no output head' if head is None else 'no input embeddings' if embed is None else 'none'}"
                          "; set TensorParallel(sequence_parallel=False)")
    blocks[0].register_forward_pre_hook(_first_input(_Split.apply, group), with_kwargs=True)
    for parent in parents:
        parent.register_forward_pre_hook(_first_input(_Gather.apply, group), with_kwargs=True)
    head.register_forward_pre_hook(_first_input(_GatherReplicated.apply, group), with_kwargs=True)
    outside = {id(p) for m in (embed, head) for p in m.parameters()} | {id(p) for p in sharded}
    for p in model.parameters():
        if p.requires_grad and id(p) not in outside:
            p.register_hook(_sum_over(group))


def _blocks(model: nn.Module, parents: list[nn.Module]) -> nn.ModuleList | None:
    """The ModuleList whose children hold every colwise parent (a transformer's layers)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module):
            inside = {id(m) for block in module for m in block.modules()}
            if parents and all(id(p) in inside for p in parents):
                return module
    return None
