"""ShardState: the tensors one rank owns for stages 0-2, bound to its module.

Per bucket a rank holds:
- ``params``: the full flat compute-dtype buffer; the module's parameters are views into it;
- ``grads`` (replicated gradients) the full flat gradient buffer, the parameters' ``.grad``
  being views into it, or ``grad_shard`` (sharded gradients) only the sum of its own slice;
- ``master``: fp32 weights over the slice it updates (a view into ``params`` when those are
  already fp32 and replicated, so fp32 training keeps no second copy);
- ``state``: the optimizer's fp32 moments over the same slice.

Gradients live for one step: allocated zeroed when its backward begins and released after the
update (``zero_grad(set_to_none=True)``'s semantics), so between steps a rank holds parameters
and optimizer state only; during a step it holds the paper's figure.

What a stage shards comes from its StagePlan; nothing here branches on the stage number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_ray.owner.accounting import StateBytes

from zero_ray.core.layout import Bucket, FlatLayout
from zero_ray.core.optim import Optimizer, takes_weight_decay
from zero_ray.core.stages import Residency, StagePlan


@dataclass(kw_only=True)
class BucketState:
    """One bucket's tensors on this rank."""

    spec: Bucket
    update_start: int
    update_end: int
    params: torch.Tensor
    master: torch.Tensor
    master_is_view: bool
    state: dict[str, torch.Tensor]
    decay: list[tuple[int, int]]  # ranges of the update slice that take weight decay
    grads: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None

    @property
    def update_real(self) -> int:
        return self.spec.real_in_range(self.update_start, self.update_end)

    @property
    def update_numel(self) -> int:
        return self.update_end - self.update_start


@dataclass(kw_only=True)
class ShardState:
    """Everything one rank holds of the model state, and how it maps onto its module."""

    layout: FlatLayout
    plan: StagePlan
    rank: int
    compute_dtype: torch.dtype
    buckets: list[BucketState]
    parameters: list[torch.nn.Parameter] = field(repr=False)
    optimizer_steps: int = 0

    @classmethod
    def bind(cls, module: torch.nn.Module, *, layout: FlatLayout, plan: StagePlan, rank: int,
             compute_dtype: torch.dtype, device: torch.device, optimizer: Optimizer) -> ShardState:
        """Move ``module``'s parameters into flat buffers laid out by ``layout`` and allocate
        this rank's gradient, master and optimizer tensors."""
        parameters = [p for _, p in module.named_parameters()]
        fp32_source = [p.detach().to(device=device, dtype=torch.float32).reshape(-1) for p in parameters]
        buckets: list[BucketState] = []
        for spec in layout.buckets:
            params = torch.zeros(spec.padded_numel, dtype=compute_dtype, device=device)
            if plan.updates_whole_buffer:
                start, end = 0, spec.padded_numel
            else:
                start, end = spec.shard_range(rank)
            master_is_view = compute_dtype == torch.float32
            master = params[start:end] if master_is_view else torch.zeros(end - start, dtype=torch.float32, device=device)
            for frag in layout.fragments(spec.index, start, end):
                if not master_is_view:
                    master[frag.local_start:frag.local_end] = fp32_source[frag.param][frag.param_start:frag.param_end]
            for i in spec.params:
                p = layout.params[i]
                params[p.offset:p.end] = fp32_source[i]
                parameters[i].data = params[p.offset:p.end].view(p.shape)
            decay = [
                (f.local_start, f.local_end)
                for f in layout.fragments(spec.index, start, end)
                if takes_weight_decay(layout.params[f.param].name, layout.params[f.param].shape, optimizer.no_decay)
            ]
            state = {name: torch.zeros(end - start, dtype=torch.float32, device=device) for name in optimizer.state_names}
            bucket = BucketState(spec=spec, update_start=start, update_end=end, params=params, master=master,
                                 master_is_view=master_is_view, state=state, decay=_merge(decay))
            buckets.append(bucket)
        shard = cls(layout=layout, plan=plan, rank=rank, compute_dtype=compute_dtype, buckets=buckets,
                    parameters=parameters)
        shard.acquire_grads()
        return shard

    # -- the gradients' lifetime: one step -------------------------------------------------------
    @property
    def grads_held(self) -> bool:
        """Whether gradient buffers exist (from a step's first backward to its update)."""
        return any(b.grads is not None or b.grad_shard is not None for b in self.buckets)

    def acquire_grads(self) -> None:
        """Allocate this step's zeroed gradient buffers (a no-op while they are held): the full
        flat buffer with the parameters' ``.grad`` as views (replicated gradients) or this rank's
        slice (sharded)."""
        if self.grads_held:
            return
        for b in self.buckets:
            spec = b.spec
            if self.plan.gradients is Residency.REPLICATED:
                b.grads = torch.zeros(spec.padded_numel, dtype=self.compute_dtype, device=b.params.device)
                for i in spec.params:
                    p = self.layout.params[i]
                    self.parameters[i].grad = b.grads[p.offset:p.end].view(p.shape)
            else:
                lo, hi = spec.shard_range(self.rank)
                b.grad_shard = torch.zeros(hi - lo, dtype=self.compute_dtype, device=b.params.device)

    def release_grads(self) -> None:
        """Drop the gradients once the update has used them, as ``zero_grad(set_to_none=True)``
        does: nothing reads them before the next step's backward, so between steps a rank holds
        only parameters and optimizer state. A collective still writing into a dropped buffer
        (an interrupted step) keeps it alive until it finishes and cannot touch the next step's."""
        for b in self.buckets:
            b.grads, b.grad_shard = None, None
        for p in self.parameters:
            p.grad = None

    # -- gradients available to the update -------------------------------------------------------
    def update_grad(self, bucket: BucketState) -> torch.Tensor:
        """The reduced gradient over ``bucket``'s update slice (compute dtype; a view)."""
        if bucket.grad_shard is not None:
            return bucket.grad_shard
        assert bucket.grads is not None
        return bucket.grads[bucket.update_start:bucket.update_end]

    def check_grad_views(self) -> None:
        """Replicated gradients accumulate in place into the flat buffer; a ``.grad`` that was
        replaced (e.g. ``zero_grad(set_to_none=True)`` inside ``loss_fn``) is folded back."""
        for b in self.buckets:
            if b.grads is None:
                continue
            for i in b.spec.params:
                p = self.layout.params[i]
                view = b.grads[p.offset:p.end].view(p.shape)
                g = self.parameters[i].grad
                if g is None or g.data_ptr() != view.data_ptr():
                    if g is not None:
                        view.copy_(g)
                    self.parameters[i].grad = view

    # -- accounting -------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Model-state bytes by category, measured from the tensors held; padding apart."""
        counter = StateBytes()
        report, count = counter.report, counter.count

        for b in self.buckets:
            count("params", b.params, b.spec.numel)
            if b.grads is not None:
                count("grads", b.grads, b.spec.numel)
            if b.grad_shard is not None:
                lo, hi = b.spec.shard_range(self.rank)
                count("grads", b.grad_shard, b.spec.real_in_range(lo, hi))
            if not b.master_is_view:
                count("optimizer_master", b.master, b.update_real)
            for t in b.state.values():
                count("optimizer_moments", t, b.update_real)
        report["optimizer"] = report["optimizer_master"] + report["optimizer_moments"]
        report["total"] = report["params"] + report["grads"] + report["optimizer"] + report["padding"]
        report["held_storage_bytes"] = self._held_storage_bytes()
        return report

    def _held_storage_bytes(self) -> int:
        """Bytes of the distinct storages behind every tensor this rank holds (an independent
        count: views of one buffer are counted once)."""
        seen: dict[int, int] = {}
        tensors: list[torch.Tensor] = []
        for b in self.buckets:
            tensors += [b.params, b.master, *b.state.values()]
            tensors += [t for t in (b.grads, b.grad_shard) if t is not None]
        tensors += [p.data for p in self.parameters]
        tensors += [p.grad for p in self.parameters if p.grad is not None]
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """This rank's fp32 weights: name -> (start, end, values) over the flattened parameter."""
        out: dict[str, tuple[int, int, torch.Tensor]] = {}
        for b in self.buckets:
            for f in self.layout.fragments(b.spec.index, b.update_start, b.update_end):
                name = self.layout.params[f.param].name
                out[name] = (f.param_start, f.param_end, b.master[f.local_start:f.local_end].float().cpu().clone())
        return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Coalesce adjacent ranges so weight decay touches as few slices as possible."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged
