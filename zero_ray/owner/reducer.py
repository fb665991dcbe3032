"""Gradient reduction: how backward's gradients become each rank's reduced update gradient.

Two mechanisms, chosen by the plan's gradient residency:
- ``AccumulatedReducer`` (replicated gradients, stages 0-1): autograd accumulates every
  micro-batch into the flat gradient buffers; during the last micro-batch's backward each
  bucket is all-reduced (replicated optimizer) or reduce-scattered (sharded optimizer) in place
  as soon as its last gradient has accumulated.
- ``BucketReducer`` (sharded gradients, stage 2): as backward produces a parameter's gradient
  it is copied into its bucket's staging buffer and dropped; a full bucket is reduce-scattered
  and only this rank's slice is kept, so no full gradient buffer outlives the buckets in flight.
  At most ``STAGING_BUFFERS`` staging buffers exist, whatever the model's size.

Both overlap communication with the rest of backward: a bucket's collective runs on a
``CommStream`` thread while the compute thread goes on with backward, and the micro-batch ends
(stage 2) or the step's backward ends (stages 0-1) by waiting for all of them. Buckets are
launched strictly in index order, so every rank issues the same collectives in the same order,
and each is the same collective on the same buffer as when it ran on the compute thread: the
results are bit-identical.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zero_ray.collective.group import Collective
from zero_ray.collective.stream import CommStream
from zero_ray.core.stages import GradReduction, Residency
from zero_ray.errors import ModelError
from zero_ray.owner.shard import BucketState, ShardState

log = logging.getLogger(__name__)

#: stage-2 staging buffers (each as large as the largest bucket): one being filled by backward
#: while the other is reduce-scattered; ZeRO-R's constant-size buffer, independent of the model
STAGING_BUFFERS = 2


class GradReducer(Protocol):
    """How the engine drives gradient reduction: around every micro-batch's forward and
    backward, then ``close()`` when the step is discarded or the group replaced."""

    def begin_micro_batch(self) -> None:
        """Before the micro-batch's forward."""
        ...

    def end_micro_batch(self, *, last: bool) -> None:
        """After its backward: returns once this micro-batch's (or, with ``last``, the step's)
        reductions are complete; raises the first collective failure."""
        ...

    def peak_staging_bytes(self) -> int:
        """The most bytes of gradient staging buffers allocated at once."""
        ...

    def close(self) -> None:
        """Stop: no hook fires and no collective runs afterwards; returns promptly on an
        aborted group."""
        ...


class _OverlappedReducer:
    """What both reducers share: post-accumulate-grad hooks that count each bucket's arrived
    gradients, and the launch of complete buckets, in index order, on a communication thread.

    Subclasses say what a gradient's arrival does (``_arrive``) and submit a bucket's
    collective (``_reduce``)."""

    def __init__(self, shard: ShardState, group: Collective) -> None:
        self._shard = shard
        self._stream = CommStream(group, name=f"zero_ray-grads-{shard.rank}")
        self._bucket_of = [p.bucket for p in shard.layout.params]
        self._pending = [len(b.spec.params) for b in shard.buckets]
        self._next = 0  # lowest bucket index not yet launched this micro-batch
        self._active = False  # this micro-batch's buckets are reduced as their gradients arrive
        self._launched = False  # collectives submitted and not yet waited for
        self._handles = [param.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, param in enumerate(shard.parameters)]

    def _make_hook(self, index: int):  # type: ignore[no-untyped-def]
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index, param)

        return hook

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self._active:
            return  # stages 0-1 before the last micro-batch: autograd only accumulates
        b = self._bucket_of[index]
        if b < self._next:
            raise ModelError(f"a gradient of {self._shard.layout.params[index].name!r} arrived after its bucket "
                             "was reduced: each parameter's gradient must accumulate once per backward")
        if self._arrive(index, param):
            self._pending[b] -= 1
            self._launch(every=False)

    def _launch(self, *, every: bool) -> None:
        """Submit, in index order, each bucket whose gradients have all arrived (``every``: all
        remaining buckets; a parameter that got no gradient counts as zero)."""
        buckets = self._shard.buckets
        while self._next < len(buckets) and (every or self._pending[self._next] == 0):
            self._launched = True
            self._reduce(buckets[self._next])
            self._next += 1

    def _start(self) -> None:
        """Reduce this micro-batch's buckets as their gradients arrive."""
        self._active, self._next = True, 0
        self._pending = [len(b.spec.params) for b in self._shard.buckets]

    def _finish(self) -> None:
        """Launch what is left and wait for every collective of the micro-batch."""
        self._launch(every=True)
        self._active = False
        self._stream.drain()
        self._launched = False

    def _arrive(self, index: int, param: torch.Tensor) -> bool:
        """Take parameter ``index``'s gradient; whether it counts as arrived."""
        raise NotImplementedError

    def _reduce(self, bucket: BucketState) -> None:
        """Submit ``bucket``'s collective to the stream."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop reducing: remove the hooks, cancel the collectives not started and wait for the
        one running (it fails at once on an aborted group). An interrupted micro-batch's
        collectives may have written partial sums into the gradients; they are released, so
        the next step starts from fresh zeroed buffers."""
        for h in self._handles:
            h.remove()
        self._handles, self._active = [], False
        interrupted = self._launched
        self._stream.cancel()
        self._stream.close()
        if interrupted:
            self._shard.release_grads()
            self._launched = False


class AccumulatedReducer(_OverlappedReducer):
    """Stages 0-1: reduce the accumulated full gradient once per step, bucket by bucket during
    the last micro-batch's backward.

    Which micro-batch is the last must be known before its backward: from ``micro_batches``
    (the engine always runs ``grad_accum_steps`` per step) when given, otherwise learned from
    the first step, which then reduces every bucket after its backward.
    """

    def __init__(self, shard: ShardState, group: Collective, *, micro_batches: int | None = None) -> None:
        super().__init__(shard, group)
        self._all_reduce = shard.plan.grad_reduction is GradReduction.ALL_REDUCE
        self._per_step = micro_batches
        self._index = 0  # of the current micro-batch within the step

    def begin_micro_batch(self) -> None:
        if self._per_step is not None and self._index == self._per_step - 1:
            self._start()

    def end_micro_batch(self, *, last: bool) -> None:
        if self._active and not last:
            raise ModelError(f"micro-batch {self._index + 1} was reduced as the step's last but more followed; "
                             "every step must run the same number of micro-batches")
        # Safe beside collectives in flight: a launched bucket's parameters all passed _arrive,
        # so their views are intact and nothing is copied into a buffer being reduced.
        self._shard.check_grad_views()
        if not last:
            self._index += 1
            return
        if not self._active:
            self._start()
        self._finish()
        self._per_step, self._index = self._index + 1, 0

    def _arrive(self, index: int, param: torch.Tensor) -> bool:
        # A gradient replaced rather than accumulated in place (e.g. zero_grad(set_to_none=True)
        # inside loss_fn) is folded back into the flat buffer before its bucket is reduced, as
        # ShardState.check_grad_views does after backward.
        spec = self._shard.layout.params[index]
        grads = self._shard.buckets[spec.bucket].grads
        assert grads is not None
        view = grads[spec.offset:spec.end].view(spec.shape)
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view
        return True

    def _reduce(self, bucket: BucketState) -> None:
        grads, group = bucket.grads, self._stream.group
        assert grads is not None
        self._stream.submit(functools.partial(group.all_reduce_ if self._all_reduce else group.reduce_scatter_, grads))

    def peak_staging_bytes(self) -> int:
        return 0


@dataclass(kw_only=True)
class _Staging:
    """A stage-2 staging buffer and the reduce-scatter last launched from it."""

    tensor: torch.Tensor
    done: Future[Any] | None = None
    temporary: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class BucketReducer(_OverlappedReducer):
    """Stage 2: reduce-scatter each bucket as soon as backward has filled it, from one of at
    most ``STAGING_BUFFERS`` staging buffers."""

    def __init__(self, shard: ShardState, group: Collective) -> None:
        super().__init__(shard, group)
        self._numel = max(b.spec.padded_numel for b in shard.buckets)
        self._pool: list[_Staging] = []  # allocated on first use, kept for the reducer's life
        self._free: list[_Staging] = []  # pool buffers not being filled (perhaps still reduced), oldest first
        self._filling: dict[int, _Staging] = {}
        self._arrived = [False] * len(shard.parameters)
        self._temporary_bytes = 0
        self._peak = 0

    def begin_micro_batch(self) -> None:
        self._start()
        self._arrived = [False] * len(self._arrived)

    def end_micro_batch(self, *, last: bool) -> None:
        self._finish()
        self._temporary_bytes = 0

    def peak_staging_bytes(self) -> int:
        return self._peak

    def _arrive(self, index: int, param: torch.Tensor) -> bool:
        grad = param.grad
        if grad is None:
            return False
        spec = self._shard.layout.params[index]
        self._staging(spec.bucket).tensor[spec.offset:spec.end].copy_(grad.reshape(-1))
        param.grad = None
        self._arrived[index] = True
        return True

    def _staging(self, b: int) -> _Staging:
        staging = self._filling.get(b)
        if staging is not None:
            return staging
        idle = bool(self._free) and (self._free[0].done is None or self._free[0].done.done())
        if not idle and len(self._pool) < STAGING_BUFFERS:
            staging = _Staging(tensor=self._new_buffer(self._numel))
            self._pool.append(staging)
        elif self._free:
            staging = self._free.pop(0)
            if staging.done is not None:
                staging.done.result()  # its previous bucket's reduce-scatter has finished with it
        else:
            # Every buffer holds a bucket still being filled: gradients arrive out of bucket
            # order. A temporary buffer (counted in the peak) rather than waiting forever.
            log.warning("stage 2: gradients of %d buckets arrived interleaved; using a temporary staging buffer",
                        len(self._filling) + 1)
            staging = _Staging(tensor=self._new_buffer(self._shard.buckets[b].spec.padded_numel), temporary=True)
            self._temporary_bytes += staging.nbytes
        staging.done = None
        self._filling[b] = staging
        self._peak = max(self._peak, self._temporary_bytes + sum(s.nbytes for s in self._pool))
        return staging

    def _new_buffer(self, numel: int) -> torch.Tensor:
        params = self._shard.buckets[0].params
        return torch.empty(numel, dtype=params.dtype, device=params.device)

    def _reduce(self, bucket: BucketState) -> None:
        staging = self._staging(bucket.spec.index)
        del self._filling[bucket.spec.index]
        buf = staging.tensor[:bucket.spec.padded_numel]
        self._zero_gaps(bucket, buf)
        group, shard = self._stream.group, bucket.grad_shard
        assert shard is not None

        def job() -> None:
            shard.add_(group.reduce_scatter_(buf))

        staging.done = self._stream.submit(job)
        if not staging.temporary:
            self._free.append(staging)

    def _zero_gaps(self, bucket: BucketState, buf: torch.Tensor) -> None:
        """Zero what no gradient was copied over: the padding, and any parameter that got no
        gradient this micro-batch (a reused buffer holds an earlier bucket's partial sums)."""
        for i in bucket.spec.params:
            if not self._arrived[i]:
                p = self._shard.layout.params[i]
                buf[p.offset:p.end].zero_()
        buf[bucket.spec.numel:].zero_()

    def close(self) -> None:
        super().close()
        self._pool, self._free, self._filling = [], [], {}


def make_reducer(shard: ShardState, group: Collective, *, micro_batches: int | None = None) -> GradReducer:
    """The reducer the plan's gradient residency calls for. ``micro_batches``: how many the
    engine runs per step (lets stages 0-1 overlap from the first step on)."""
    if shard.plan.gradients is Residency.SHARDED:
        return BucketReducer(shard, group)
    return AccumulatedReducer(shard, group, micro_batches=micro_batches)
