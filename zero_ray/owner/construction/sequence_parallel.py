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

The gathers and reduce-scatters are group_ops' custom ops (``zero_ray::tp_gather_sequence``,
``tp_reduce_scatter_sequence``), so a compiled block keeps them in its graph: as plain
``Collective`` calls dynamo broke the graph at each, and the first compiled step failed with
``TypeError: expected an instance of Token`` inside ``LlamaAttention`` as the all-reduce once did.

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
from zero_ray.owner.construction.group_ops import (
    SEQUENCE_OP,
    all_reduce_sum,
    register_group,
    tp_gather_sequence,
    tp_reduce_scatter_sequence,
)

OP = SEQUENCE_OP  # counted as tp_sequence by the TP group


def _check(x: torch.Tensor, size: int) -> None:
    if x.dim() < 2 or x.shape[1] % size:
        raise ConfigError(f"sequence_parallel splits dimension 1 (the sequence) over the tensor_parallel size={size}, "
                          f"but a block's input has shape {tuple(x.shape)}; pad the sequences to a multiple of {size} "
                          "or set TensorParallel(sequence_parallel=False)")


def chunk_sequence(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s chunk along dimension 1 (a copy, so the whole tensor can be freed: with one
    sequence in the batch the chunk is contiguous already, and a view would keep all of it)."""
    _check(full, size)
    return full.chunk(size, dim=1)[rank].clone(memory_format=torch.contiguous_format)


# The autograd functions take the group as its handle and plain integers, never the Collective:
# inside a compiled block (the attention's and MLP's gathers, the rowwise reduce-scatters) dynamo
# traces them, and the collectives are group_ops' custom ops, one graph node each.

class _Split(torch.autograd.Function):
    """Region start: keep this rank's chunk; backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int, rank: int, size: int) -> torch.Tensor:
        ctx.handle = handle
        return chunk_sequence(x, rank, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return tp_gather_sequence(grad.contiguous(), ctx.handle), None, None, None


class _Gather(torch.autograd.Function):
    """A colwise parent's input: all-gather; backward reduce-scatters the partial gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int, rank: int, size: int) -> torch.Tensor:
        ctx.handle = handle
        return tp_gather_sequence(x.contiguous(), handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return tp_reduce_scatter_sequence(grad.contiguous(), ctx.handle), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """A rowwise layer's partial outputs: reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int, rank: int, size: int) -> torch.Tensor:
        ctx.handle = handle
        _check(x, size)
        return tp_reduce_scatter_sequence(x.contiguous(), handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return tp_gather_sequence(grad.contiguous(), ctx.handle), None, None, None


class _GatherReplicated(torch.autograd.Function):
    """Region end (the head's input): all-gather; the gradient, the same on every rank, is cut."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: int, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        return tp_gather_sequence(x.contiguous(), handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return chunk_sequence(grad, ctx.rank, ctx.size), None, None, None


def reduce_scatter_output(x: torch.Tensor, handle: int, rank: int, size: int) -> torch.Tensor:
    """A rowwise layer's output under sequence parallelism (``ShardedLinear``; ``handle`` its group's)."""
    return _ReduceScatter.apply(x, handle, rank, size)


def _first_input(function: type[torch.autograd.Function], group: Collective) -> Any:
    """A forward pre-hook (with kwargs) replacing the hidden state, the first positional
    argument or ``hidden_states`` / ``x``, by ``function`` applied to it over ``group``."""
    handle, rank, size = register_group(group), group.rank, group.world_size

    def apply(x: torch.Tensor) -> torch.Tensor:
        return function.apply(x, handle, rank, size)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if args and isinstance(args[0], torch.Tensor):
            return (apply(args[0]), *args[1:]), kwargs
        for key in ("hidden_states", "x"):
            if isinstance(kwargs.get(key), torch.Tensor):
                return args, {**kwargs, key: apply(kwargs[key])}
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
    blocks[0].register_forward_pre_hook(_first_input(_Split, group), with_kwargs=True)
    for parent in parents:
        parent.register_forward_pre_hook(_first_input(_Gather, group), with_kwargs=True)
    head.register_forward_pre_hook(_first_input(_GatherReplicated, group), with_kwargs=True)
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
