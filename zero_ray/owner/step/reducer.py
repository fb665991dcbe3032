"""GradReducer: when each group's gradients are reduced, overlapped with backward.

The reducer puts a post-accumulate-grad hook on every trainable group's parameters: each hands
its gradient to the group (``ParamGroup.accept_grad``), and once a group's gradients are all in
the reducer submits its collective to the rank's ``CommStream`` thread while the compute thread
goes on with backward. Which micro-batches reduce is the group's
``GradFlow``: ACCUMULATE groups reduce once per step, during the last micro-batch's backward;
PER_MICRO_BATCH groups every micro-batch. A micro-batch ends (``end_micro_batch``) by launching
whatever is left, parameters that got no gradient contributing zeros, and waiting for all of it.

Order. Every rank must submit the same collectives in the same order, whatever its data. The
reducer launches groups strictly in the order of its queue, each once it is ready, so a group
whose gradients come early on one rank and late on another (a parameter only some ranks use)
only delays the ones behind it. The queue is structural, the same on every rank: groups whose
parameters stay whole are queued in index order when the micro-batch starts (the order backward
usually fills them), unless the model also has units gathered per use; those are queued as their
backward begins, a unit ahead of any enclosing unit already queued (a nested unit finishes
first), and the whole groups go last. Each launch is the same collective on the same buffer as a
synchronous reduction, so the results are bit-identical.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from zero_ray.collective.stream import CommStream
from zero_ray.core.group_policy import GradFlow, ParamResidency
from zero_ray.errors import ModelError
from zero_ray.owner.tensors.buffers import BufferPool
from zero_ray.owner.step.param_group import ParamGroup


class GradReducer:
    """The gradient reduction of one rank's trainable groups (``ModelState.trainable_groups``)."""

    def __init__(self, groups: Sequence[ParamGroup], stream: CommStream, *, micro_batches: int | None,
                 staging: Sequence[BufferPool] = ()) -> None:
        assert all(g.trainable for g in groups), "the reducer takes the trainable groups only"
        self.groups = list(groups)
        self.stream = stream  # the rank's comm thread (the model state's), where reductions are issued
        self._staging = list(staging)
        per_use = any(g.policy.params is ParamResidency.PER_USE for g in self.groups)
        whole = [g for g in self.groups if g.policy.params is ParamResidency.WHOLE]
        self._head = [] if per_use else whole  # queued when a micro-batch starts
        self._tail = whole if per_use else []  # queued when it ends
        # Micro-batches per step, which says which one is the last before its backward; None:
        # learned from the first step, which then reduces ACCUMULATE groups after its backward.
        self.micro_batches = micro_batches
        self._index = 0  # of the current micro-batch within the step
        self._queue: list[ParamGroup] = []
        self._ready: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, k))
                       for g in self.groups for k, p in enumerate(g.params)]

    def _on_grad(self, group: ParamGroup, k: int, param: torch.Tensor) -> None:
        if group.accept_grad(k, param):
            self.group_ready(group)

    # -- the micro-batch ------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        """Before the micro-batch's forward."""
        last = self.micro_batches is not None and self._index == self.micro_batches - 1
        for g in self.groups:
            g.acquire_grads()
            g.begin_micro_batch(active=g.policy.grads is GradFlow.PER_MICRO_BATCH or last)
        self._queue = [g for g in self._head if g.active]
        self._ready = set()

    def enqueue(self, group: ParamGroup, *, before: ParamGroup | None = None) -> None:
        """Queue ``group`` (its unit's backward began), ahead of ``before`` when that is queued."""
        if group in self._queue or not group.active or group.launched:
            return
        at = self._queue.index(before) if before is not None and before in self._queue else len(self._queue)
        self._queue.insert(at, group)

    def group_ready(self, group: ParamGroup) -> None:
        """``group``'s gradients for this micro-batch are all in (its hooks, or its unit's end)."""
        self._ready.add(group.index)
        if group in self._tail:
            return  # queued when the micro-batch ends, after every unit, whenever it is ready
        if group not in self._queue:
            self.enqueue(group)
        self._launch()

    def _launch(self) -> None:
        while self._queue and self._queue[0].index in self._ready:
            self._queue.pop(0).launch(self.stream)

    def end_micro_batch(self, *, last: bool) -> None:
        """After the micro-batch's backward: returns once its (or, with ``last``, the step's)
        reductions are complete; raises the first collective failure."""
        accumulating = [g for g in self.groups if g.policy.grads is GradFlow.ACCUMULATE]
        if not last and any(g.active for g in accumulating):
            raise ModelError(f"micro-batch {self._index + 1} was reduced as the step's last but more followed; "
                             "every step must run the same number of micro-batches")
        for g in accumulating:
            g.check_grad_views()
        if last:
            for g in accumulating:
                if not g.active:  # the first step, before the count is known: reduce them all now
                    g.begin_micro_batch(active=True)
        due = [g for g in self.groups if g.active and not g.launched]
        if due:
            for g in sorted(due, key=lambda g: (g in self._tail, g.index)):
                self.enqueue(g)
                self._ready.add(g.index)
            self._launch()
        for pool in self._staging:
            pool.end_micro_batch()
        self.stream.drain()
        if last:
            self.micro_batches, self._index = self._index + 1, 0
        else:
            self._index += 1

    def unit_done(self, group: ParamGroup) -> None:
        """The backward of ``group``'s unit is over: what has not arrived counts as zero."""
        if group.active and not group.launched:
            self.group_ready(group)

    def peak_staging_bytes(self) -> int:
        """The most bytes of gradient staging buffers held at once."""
        return sum(pool.peak_bytes for pool in self._staging)

    # -- interruption ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget an interrupted micro-batch: cancel collectives not started, wait for the one
        running (at once on an aborted group) and release every gradient, so the next step
        starts from fresh zeroed buffers whatever a collective wrote."""
        self.stream.cancel()
        for g in self.groups:
            g.release_grads()
            g.active = g.launched = False
        for pool in self._staging:
            pool.reset()
        self._queue, self._ready = [], set()
        self._index = 0

    def close(self) -> None:
        """Stop, and the comm stream with it: no collective runs afterwards; returns promptly on
        an aborted group."""
        self.reset()
        self.stream.close()
