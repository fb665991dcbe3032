"""The tensor-parallel layers' collectives as torch custom ops, so ``torch.compile`` keeps them in
the graph as opaque calls instead of breaking the graph around them: the layers' all-reduce, and
sequence parallelism's all-gather and reduce-scatter along the sequence (sequence_parallel.py).

A ``Collective`` is a Python object (barriers, gloo pairs, a comm stream's locks) that dynamo
cannot trace: called directly inside a compiled block it splits the block's graph at every
layer's all-reduce, and a graph break inside a forward that a library wraps in a context
variable (transformers' ``use_kernelized_func`` on ``LlamaAttention``, through ``kernels``)
resumes with that variable's token rebuilt wrongly (``TypeError: expected an instance of
Token``). As ``zero_ray::tp_all_reduce`` (``tp_gather_sequence``, ``tp_reduce_scatter_sequence``)
each collective is one node of the compiled graph (its fake
implementation gives the shape), run eagerly by inductor's generated code, in graph order, which
is the same on every rank of the group (they compile the same block).

The ops take the group by an integer handle (custom ops accept only tensors and scalars):
``register_group`` assigns it; the registry holds groups weakly, so a group outlives no module.
A fake implementation gives each result's shape (the gather's sequence T times longer, the
reduce-scatter's 1/T), reading T from the registered group.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from zero_ray.collective.collective_api import Collective

_GROUPS: weakref.WeakValueDictionary[int, Collective] = weakref.WeakValueDictionary()
_HANDLES: dict[int, int] = {}  # id(group) -> handle, for groups registered twice
_NEXT = itertools.count(1)
_LOCK = threading.Lock()  # thread ranks register their groups at once
SEQUENCE_OP = "sequence"  # sequence parallelism's bytes, counted as tp_sequence by the TP group


def register_group(group: Collective) -> int:
    """The handle ``tp_all_reduce`` takes for ``group`` (the same handle for the same group)."""
    with _LOCK:
        handle = _HANDLES.get(id(group))
        if handle is not None and _GROUPS.get(handle) is group:
            return handle
        handle = next(_NEXT)
        _GROUPS[handle] = group
        _HANDLES[id(group)] = handle
        return handle


def all_reduce_sum(group: Collective, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over ``group`` (a new contiguous tensor of its shape). The Collective
    reduces flat buffers a multiple of the group's size long, so the values travel zero-padded."""
    flat = tensor.detach().reshape(-1)
    n, size = flat.numel(), group.world_size
    buf = torch.zeros(n + (-n) % size, dtype=tensor.dtype, device=tensor.device)
    buf[:n].copy_(flat)
    group.all_reduce_(buf)
    return buf[:n].view(tensor.shape)


def _group(handle: int) -> Collective:
    group = _GROUPS.get(handle)
    if group is None:  # a module outliving its group: a bug, not a user's error
        raise RuntimeError(f"tensor-parallel group handle {handle} is not registered (its group was freed)")
    return group


def gather_sequence(group: Collective, local: torch.Tensor) -> torch.Tensor:
    """Every rank's chunk ``local`` (B, S/T, ...) joined along dimension 1 in rank order."""
    size = group.world_size
    buf = torch.empty((size, *local.shape), dtype=local.dtype, device=local.device)
    buf[group.rank].copy_(local)
    group.all_gather_(buf.view(-1), op=SEQUENCE_OP)
    return buf.transpose(0, 1).reshape(local.shape[0], size * local.shape[1], *local.shape[2:])


def reduce_scatter_sequence(group: Collective, full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk along dimension 1 of ``full`` (B, S, ...; S a multiple of the group's
    size, checked by the caller) summed over the group."""
    size = group.world_size
    b, s = full.shape[0], full.shape[1]
    buf = full.reshape(b, size, s // size, *full.shape[2:]).transpose(0, 1).contiguous()
    out = group.reduce_scatter_(buf.view(-1), op=SEQUENCE_OP)
    return out.view(buf.shape[1:]).clone()  # a copy: a view would keep all T chunks alive


def _all_reduce(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return all_reduce_sum(_group(handle), tensor)


def _gather(local: torch.Tensor, handle: int) -> torch.Tensor:
    return gather_sequence(_group(handle), local.contiguous())


def _reduce_scatter(full: torch.Tensor, handle: int) -> torch.Tensor:
    return reduce_scatter_sequence(_group(handle), full)


# Each op's eager body by its name: a TorchDispatchMode sees a custom op as one call and not the
# tensors it allocates inside, so a mode that counts allocations (benchmarks.tensor_parallel's
# RankBytes) runs the body itself, under the mode.
BODIES: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "zero_ray::tp_all_reduce": _all_reduce,
    "zero_ray::tp_gather_sequence": _gather,
    "zero_ray::tp_reduce_scatter_sequence": _reduce_scatter,
}


@torch.library.custom_op("zero_ray::tp_all_reduce", mutates_args=())
def tp_all_reduce(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    """``tensor`` summed over the group registered as ``handle``."""
    return _all_reduce(tensor, handle)


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor.new_empty(tensor.shape)  # contiguous, as the real result is


@torch.library.custom_op("zero_ray::tp_gather_sequence", mutates_args=())
def tp_gather_sequence(local: torch.Tensor, handle: int) -> torch.Tensor:
    """Every rank's ``local`` (B, S/T, ...) joined along the sequence over the group ``handle``."""
    return _gather(local, handle)


@tp_gather_sequence.register_fake
def _tp_gather_sequence_fake(local: torch.Tensor, handle: int) -> torch.Tensor:
    size = _group(handle).world_size
    return local.new_empty((local.shape[0], size * local.shape[1], *local.shape[2:]))


@torch.library.custom_op("zero_ray::tp_reduce_scatter_sequence", mutates_args=())
def tp_reduce_scatter_sequence(full: torch.Tensor, handle: int) -> torch.Tensor:
    """This rank's chunk along the sequence of ``full`` (B, S, ...) summed over the group ``handle``."""
    return _reduce_scatter(full, handle)


@tp_reduce_scatter_sequence.register_fake
def _tp_reduce_scatter_sequence_fake(full: torch.Tensor, handle: int) -> torch.Tensor:
    size = _group(handle).world_size
    return full.new_empty((full.shape[0], full.shape[1] // size, *full.shape[2:]))
