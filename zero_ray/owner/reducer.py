"""Gradient reduction: how backward's gradients become each rank's reduced update gradient.

Two mechanisms, chosen by the plan's gradient residency:
- ``AccumulatedReducer`` (replicated gradients, stages 0-1): autograd accumulates every
  micro-batch into the flat gradient buffers; after the last micro-batch each bucket is
  all-reduced (replicated optimizer) or reduce-scattered (sharded optimizer).
- ``BucketReducer`` (sharded gradients, stage 2): as backward produces a parameter's gradient
  it is copied into its bucket's staging buffer and dropped; a full bucket is reduce-scattered
  and only this rank's slice is kept, so no full gradient buffer outlives the bucket in flight.
  Buckets are reduced strictly in index order so that every rank issues the same collectives.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_ray.collective.group import Collective
from zero_ray.core.stages import GradReduction, Residency
from zero_ray.owner.shard import BucketState, ShardState


class GradReducer(Protocol):
    def begin_micro_batch(self) -> None: ...

    def end_micro_batch(self, *, last: bool) -> None: ...

    def peak_staging_bytes(self) -> int: ...

    def close(self) -> None: ...


class AccumulatedReducer:
    """Stages 0-1: reduce the accumulated full gradient once per step."""

    def __init__(self, shard: ShardState, group: Collective) -> None:
        self._shard = shard
        self._group = group
        self._all_reduce = shard.plan.grad_reduction is GradReduction.ALL_REDUCE

    def begin_micro_batch(self) -> None:
        return None

    def end_micro_batch(self, *, last: bool) -> None:
        self._shard.check_grad_views()
        if not last:
            return
        for b in self._shard.buckets:
            assert b.grads is not None
            if self._all_reduce:
                self._group.all_reduce_(b.grads)
            else:
                self._group.reduce_scatter_(b.grads)

    def peak_staging_bytes(self) -> int:
        return 0

    def close(self) -> None:
        return None


class BucketReducer:
    """Stage 2: reduce-scatter each bucket as soon as backward has filled it."""

    def __init__(self, shard: ShardState, group: Collective) -> None:
        self._shard = shard
        self._group = group
        layout = shard.layout
        self._bucket_of = [p.bucket for p in layout.params]
        self._staging: dict[int, torch.Tensor] = {}
        self._pending = [len(b.spec.params) for b in shard.buckets]
        self._next = 0  # lowest bucket index not yet reduced this micro-batch
        self._peak = 0
        self._handles = [
            param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, param in enumerate(shard.parameters)
        ]

    def _make_hook(self, index: int):  # type: ignore[no-untyped-def]
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        b = self._bucket_of[index]
        spec = self._shard.layout.params[index]
        self._stage(b)[spec.offset:spec.end].copy_(grad.reshape(-1))
        param.grad = None
        self._pending[b] -= 1
        self._flush(upto=None)

    def _stage(self, b: int) -> torch.Tensor:
        buf = self._staging.get(b)
        if buf is None:
            bucket = self._shard.buckets[b]
            buf = torch.zeros(bucket.spec.padded_numel, dtype=bucket.params.dtype, device=bucket.params.device)
            self._staging[b] = buf
            self._peak = max(self._peak, sum(t.numel() * t.element_size() for t in self._staging.values()))
        return buf

    def _reduce(self, bucket: BucketState) -> None:
        buf = self._stage(bucket.spec.index)
        assert bucket.grad_shard is not None
        bucket.grad_shard.add_(self._group.reduce_scatter_(buf))
        del self._staging[bucket.spec.index]

    def _flush(self, *, upto: int | None) -> None:
        """Reduce, in index order, every bucket that is complete (or, at the end of backward,
        every bucket up to ``upto``: a parameter that got no gradient counts as zero)."""
        buckets = self._shard.buckets
        while self._next < len(buckets):
            if upto is None and self._pending[self._next] > 0:
                return
            self._reduce(buckets[self._next])
            self._next += 1

    def begin_micro_batch(self) -> None:
        self._next = 0
        self._pending = [len(b.spec.params) for b in self._shard.buckets]

    def end_micro_batch(self, *, last: bool) -> None:
        self._flush(upto=len(self._shard.buckets))

    def peak_staging_bytes(self) -> int:
        return self._peak

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def make_reducer(shard: ShardState, group: Collective) -> GradReducer:
    """The reducer the plan's gradient residency calls for."""
    if shard.plan.gradients is Residency.SHARDED:
        return BucketReducer(shard, group)
    return AccumulatedReducer(shard, group)
