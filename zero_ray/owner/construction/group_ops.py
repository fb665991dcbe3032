"""The tensor-parallel layers' one collective as a torch custom op, so ``torch.compile`` keeps it
in the graph as an opaque call instead of breaking the graph around it.

A ``Collective`` is a Python object (barriers, gloo pairs, a comm stream's locks) that dynamo
cannot trace: called directly inside a compiled block it splits the block's graph at every
layer's all-reduce, and a graph break inside a forward that a library wraps in a context
variable (transformers' ``use_kernelized_func`` on ``LlamaAttention``, through ``kernels``)
resumes with that variable's token rebuilt wrongly (``TypeError: expected an instance of
Token``). As ``zero_ray::tp_all_reduce`` the sum is one node of the compiled graph (its fake
implementation gives the shape), run eagerly by inductor's generated code, in graph order, which
is the same on every rank of the group (they compile the same block).

The op takes the group by an integer handle (custom ops accept only tensors and scalars):
``register_group`` assigns it; the registry holds groups weakly, so a group outlives no module.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from zero_ray.collective.collective_api import Collective

_GROUPS: weakref.WeakValueDictionary[int, Collective] = weakref.WeakValueDictionary()
_HANDLES: dict[int, int] = {}  # id(group) -> handle, for groups registered twice
_NEXT = itertools.count(1)
_LOCK = threading.Lock()  # thread ranks register their groups at once


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


@torch.library.custom_op("zero_ray::tp_all_reduce", mutates_args=())
def tp_all_reduce(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    """``tensor`` summed over the group registered as ``handle``."""
    group = _GROUPS.get(handle)
    if group is None:  # a module outliving its group: a bug, not a user's error
        raise RuntimeError(f"tensor-parallel group handle {handle} is not registered (its group was freed)")
    return all_reduce_sum(group, tensor)


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    return tensor.new_empty(tensor.shape)  # contiguous, as the real result is
