"""``full_state_dict`` under tensor parallelism: every owner's fp32 master fragments joined into
whole parameters on the driver.

Owner r holds a range of TP rank ``r % T``'s shard of each parameter (its data-parallel group
partitions that shard). The fragments of one TP rank fill its local tensors (the same shapes on
every TP rank: the plan is checked to divide evenly); a sharded module's weight is then joined
along its split dimension in TP-rank order, a colwise bias along dim 0, and a replicated
parameter (embeddings, norms, a rowwise bias) is taken from TP rank 0. Which dimension each
module is split along comes from the plan resolved on the model built on the meta device here:
no parameter memory, and the same check the owners ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zero_ray.core.tensor_parallel_plan import COLWISE, TensorParallel
from zero_ray.owner.construction.tensor_sharding import plan_model
from zero_ray.owner.step.run_spec import ModelFn

Fragments = Mapping[str, tuple[int, int, Any]]


def whole_counts(model_fn: ModelFn) -> tuple[int, int]:
    """The whole model's parameter elements, and its trainable ones (the owners' layout counts
    only their TP slice)."""
    with torch.device("meta"):
        model = model_fn()
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def split_dims(model_fn: ModelFn, tp: TensorParallel) -> dict[str, int]:
    """The dimension each sharded parameter is split along, by name (the others are whole)."""
    with torch.device("meta"):
        model = model_fn()
    dims: dict[str, int] = {}
    for shard in plan_model(model, tp).shards:
        dims[f"{shard.name}.weight"] = shard.dim
        if shard.style == COLWISE:
            dims[f"{shard.name}.bias"] = 0
    return dims


def join_fragments(gathered: Sequence[Fragments], *, local_shapes: Mapping[str, tuple[int, ...]], size: int,
                   dims: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Whole fp32 parameters (names of ``local_shapes``) from every rank's fragments, in rank
    order, over TP groups of ``size``."""
    per_tp = [{n: torch.empty(math.prod(s), dtype=torch.float32) for n, s in local_shapes.items()}
              for _ in range(size)]
    for rank, fragments in enumerate(gathered):
        local = per_tp[rank % size]
        for name, (lo, hi, values) in fragments.items():
            if name in local:
                local[name][lo:hi] = values
    out = {}
    for name, shape in local_shapes.items():
        parts = [p[name].view(shape) for p in per_tp]
        dim = dims.get(name)
        out[name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    return out
