"""Splitting a global batch along dim 0 (pure: torch only, no ray).

A batch is a tensor, a tuple/list of tensors or a dict of tensors; every tensor shares the size
of dim 0. Splits are as even as possible: the first ``n % parts`` pieces get one extra sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch

from zero_ray.errors import ConfigError

Batch: TypeAlias = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` samples into ``parts`` pieces differing by at most one."""
    if parts < 1:
        raise ConfigError(f"{parts=} must be at least 1")
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)  # no per-part loop: the driver's, every step


def _leaves(batch: Batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = list(batch)
    else:
        raise ConfigError(f"a batch must be a tensor, a tuple/list or a dict of tensors, not {type(batch).__name__}")
    if not values:
        raise ConfigError("the batch is empty: it holds no tensors")
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"every element of a batch must be a tensor; found {type(v).__name__}")
        if v.dim() == 0:
            raise ConfigError("batch tensors need a batch dimension (dim 0); found a 0-d tensor")
    return values


def batch_size(batch: Batch) -> int:
    """The shared size of dim 0; a clear error when the tensors disagree."""
    sizes = {t.shape[0] for t in _leaves(batch)}
    if len(sizes) != 1:
        raise ConfigError(f"batch tensors disagree on dim 0: sizes {sorted(sizes)}")
    return sizes.pop()


def _map(batch: Batch, fn: Any) -> Batch:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: fn(v) for k, v in batch.items()}
    return type(batch)(fn(v) for v in batch) if isinstance(batch, tuple) else [fn(v) for v in batch]


def split_batch(batch: Batch, sizes: Sequence[int]) -> list[Batch]:
    """Pieces of ``batch`` with the given dim-0 sizes (views, no copies)."""
    total = batch_size(batch)
    if sum(sizes) != total:
        raise ConfigError(f"split sizes {list(sizes)} do not add up to the batch size {total}")
    pieces: list[Batch] = []
    start = 0
    for size in sizes:
        pieces.append(_map(batch, lambda t, s=start, e=start + size: t[s:e]))
        start += size
    return pieces


def to_device(batch: Batch, device: torch.device, float_dtype: torch.dtype | None) -> Batch:
    """Move a batch to ``device``; floating tensors take ``float_dtype`` when given (so inputs
    match parameters computed in bf16/fp16)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if float_dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=float_dtype)
        return t.to(device=device)

    return _map(batch, move)
