"""ParamGroup: one flat buffer of a rank's model state and everything that hangs off it.

A group plays the role FSDP2's ``FSDPParamGroup`` plays. It owns its parameters' storage (the
whole flat buffer, or this rank's shard and, while its unit is gathered, a region of a pool
buffer), its gradient buffer or reduced gradient shard, its fp32 master slice and the flat
buffers its element-wise optimizer state lives in (``moments``: one per state name, over the
update slice; the optimizer's per-fragment state tensors are views of them), the staging buffer
it fills during backward, and what each gradient arriving does (``accept_grad``: the reducer's
hooks on the parameters hand each one over and learn when the group is ready). How it behaves is its
``GroupPolicy`` (``core/group_policy.py``): data derived from the stage's plan and from whether its
parameters are trainable. Nothing here reads a stage number. The optimizer itself is
``owner/step/optimizer.py``'s.

Gradients are kept in the reduce dtype (``ZeroConfig.reduce_dtype``, by default the compute
dtype): where it differs, each backward's gradient is added into the flat buffer in that dtype
instead of the parameters' ``.grad`` being views of it.

Gradients live for one step (``zero_grad(set_to_none=True)``'s semantics): acquired when the
step's first backward begins, released after the update, so between steps a rank holds
parameters and optimizer state only. Frozen groups hold parameters only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from zero_ray.collective.stream import CommStream
from zero_ray.core.group_policy import GradFlow, GroupSpec, ParamResidency
from zero_ray.core.flat_layout import Bucket, FlatLayout
from zero_ray.core.stages import GradReduction
from zero_ray.errors import ModelError
from zero_ray.owner.tensors.accounting import StateCounter
from zero_ray.owner.tensors.buffers import BufferPool, PoolBuffer
from zero_ray.owner.tensors.state_files import StateFiles
from zero_ray.owner.construction.sources import ParamSource


@dataclass(frozen=True, kw_only=True)
class OptimizerSlice:
    """One flat range this rank updates (or, frozen, keeps): ``[start, end)`` of ``bucket``, its
    fp32 master weights (the compute-dtype parameters of a frozen group) and its element-wise
    optimizer state by name (none when frozen or not yet stepped), as views of the live tensors.
    Checkpoints, resizes and peer snapshots save and restore through these, whatever the stage."""

    bucket: Bucket
    start: int
    end: int
    master: torch.Tensor
    moments: dict[str, torch.Tensor]


class ParamGroup:
    """One group's tensors on this rank, bound to its module's parameters."""

    def __init__(self, spec: GroupSpec, *, layout: FlatLayout, params: list[nn.Parameter], rank: int,
                 dtype: torch.dtype, device: torch.device, source: ParamSource, empty: torch.Tensor,
                 staging: BufferPool | None, reduce_dtype: torch.dtype | None = None,
                 state_files: StateFiles | None = None, param_files: StateFiles | None = None) -> None:
        self.spec = spec
        self.policy = spec.policy
        self.trainable: bool = spec.policy.trainable  # asked by every step's acquire_grads
        self.bucket: Bucket = layout.buckets[spec.index]
        self.rank = rank
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype or dtype  # of the gradient buffers and their reduction
        self.grad_views = self.reduce_dtype == dtype  # the parameters' .grad are views of the flat buffer
        self.params = params
        self.members: tuple[int, ...] = self.bucket.params  # layout indices, in bucket order
        self.names: list[str] = [layout.params[i].name for i in self.members]
        self.views: list[tuple[int, int, tuple[int, ...]]] = [
            (layout.params[i].offset, layout.params[i].end, layout.params[i].shape) for i in self.members]
        self.shard_start, self.shard_end = self.bucket.shard_range(rank)
        self.update_start, self.update_end = ((0, self.bucket.padded_numel) if self.policy.update_whole
                                              else (self.shard_start, self.shard_end))
        frags = list(layout.fragments(self.bucket.index, self.update_start, self.update_end))
        self._fragments = frags
        self.pieces: list[tuple[int, int, int]] = [(f.param, f.local_start, f.local_end) for f in frags]
        self._empty = empty
        self._staging_pool = staging
        self.state_files = state_files  # where the optimizer state lives (None: in memory)
        # where the parameter and gradient shards live (Offload(params="nvme"), PER_USE groups; None: in memory)
        self.param_files = param_files if spec.policy.params is ParamResidency.PER_USE else None
        self.full: torch.Tensor | None = None  # the whole buffer (WHOLE) or the gathered region (PER_USE)
        self.shard: torch.Tensor | None = None  # this rank's compute-dtype shard (PER_USE)
        self.grads: torch.Tensor | None = None  # ACCUMULATE: the full gradient buffer, during a step
        self.grad_shard: torch.Tensor | None = None  # PER_MICRO_BATCH: this rank's reduced slice
        self.staging: PoolBuffer | None = None
        self.active = False  # this micro-batch's gradients are reduced as they arrive
        self.launched = False  # this micro-batch's reduction has been submitted
        self.pending = 0
        self.arrived = [False] * len(params)
        self.used = [False] * len(params)  # a gradient arrived in any micro-batch of this step
        self._fill(source, device)

    # -- construction ------------------------------------------------------------------------------
    def _fill(self, source: ParamSource, device: torch.device) -> None:
        fp32, dtype, bucket = torch.float32, self.dtype, self.bucket
        start, end = self.update_start, self.update_end
        trainable = self.policy.trainable
        if self.policy.params is ParamResidency.WHOLE:
            full = torch.zeros(bucket.padded_numel, dtype=dtype, device=device)
            master = torch.zeros(end - start, dtype=fp32, device=device) if trainable and dtype != fp32 else None
            for i, p, (off, stop, shape) in zip(self.members, self.params, self.views):
                value = source.fragment(i, 0, stop - off).to(device)
                full[off:stop] = value
                if master is not None:
                    lo, hi = max(off, start), min(stop, end)
                    if lo < hi:
                        master[lo - start:hi - start] = value[lo - off:hi - off]
                p.data = full[off:stop].view(shape)
            self.full = full
            self.master = master if master is not None else full[start:end]
            self.owns_master = master is not None
        else:
            files = self.param_files
            shard = (torch.zeros(end - start, dtype=fp32, device=device) if files is None
                     else files.zeros(end - start))
            for f in self._fragments:
                shard[f.local_start:f.local_end] = source.fragment(f.param, f.param_start, f.param_end).to(device)
            for p in self.params:
                p.data = self._empty
            self.shard = (shard if dtype == fp32 else shard.to(dtype) if files is None
                          else files.zeros(end - start, dtype).copy_(shard))
            self.master = shard if trainable else self.shard
            self.owns_master = self.master is not self.shard
            if files is not None:
                for t in self._param_tensors():
                    files.evict(t)  # written here; read back shard by shard as its unit is gathered
        self.moments: dict[str, torch.Tensor] = {}  # created by the optimizer's first step (or a restore)

    def moment(self, name: str) -> torch.Tensor:
        """The flat fp32 buffer of element-wise optimizer state ``name`` over the update slice,
        allocated (zeroed) on first use."""
        t = self.moments.get(name)
        if t is None:
            t = self.moments[name] = (
                torch.zeros(self.update_numel, dtype=torch.float32, device=self.master.device)
                if self.state_files is None else self.state_files.zeros(self.update_numel))
        return t

    def _param_tensors(self) -> list[torch.Tensor]:
        """The parameter-shard tensors this group keeps in files (Offload(params="nvme")): the
        fp32 master and, where the compute dtype differs, the compute-dtype shard."""
        if self.param_files is None:
            return []
        assert self.shard is not None
        return [self.master] if self.master is self.shard else [self.master, self.shard]

    def _filed(self) -> list[tuple[StateFiles, str, torch.Tensor]]:
        """Every tensor of this group's update that lives in a file, with what it is (for errors):
        optimizer state, master weights, then the reduced gradient shard."""
        out = [(self.state_files, f"optimizer state {name!r} of bucket {self.index}", t)
               for name, t in self.moments.items()] if self.state_files is not None else []
        if self.param_files is not None:
            out.append((self.param_files, f"the fp32 master weights of bucket {self.index}", self.master))
            if self.grad_shard is not None:
                out.append((self.param_files, f"the gradient shard of bucket {self.index}", self.grad_shard))
        return out

    def populate_state(self) -> None:
        """Offloaded: read this group's update state in (optimizer state and master weights
        mapped writable, the gradient shard readable) ahead of its update, which then takes no
        page faults."""
        for files, _, t in self._filed():
            files.populate(t, write=t is not self.grad_shard)

    def evict_state(self) -> None:
        """Offloaded: take this group's offloaded tensors out of memory (they stay in their files)."""
        for files, _, t in self._filed():
            files.evict(t)
        if self.param_files is not None and self.shard is not self.master:
            assert self.shard is not None
            self.param_files.evict(self.shard)

    def seal_state(self) -> None:
        """Offloaded: record the checksums of this group's optimizer state and master weights as
        the update just wrote them (the gradient shard lives one step: not checked)."""
        for files, _, t in self._filed():
            if t is not self.grad_shard:
                files.seal(t)

    def verify_state(self) -> None:
        """Offloaded: check this group's optimizer state and master weights against their
        checksums before the update uses them (StateCorruptError if the disk changed them)."""
        for files, what, t in self._filed():
            files.verify(t, what=what)

    def forget_sums(self) -> None:
        """Before a restore overwrites the master weights: their checksums no longer apply (the
        next update records new ones)."""
        if self.param_files is not None:
            for t in self._param_tensors():
                self.param_files.forget(t)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def update_numel(self) -> int:
        return self.update_end - self.update_start

    # -- the gradients' lifetime: one step -----------------------------------------------------------
    @property
    def grads_held(self) -> bool:
        return self.grads is not None or self.grad_shard is not None

    def acquire_grads(self) -> None:
        """Allocate this step's zeroed gradient buffers (a no-op while held): the full flat buffer
        (ACCUMULATE; the parameters' ``.grad`` are views of it where the dtypes agree) or this
        rank's slice."""
        if self.grads_held or not self.trainable:
            return
        if self.policy.grads is GradFlow.ACCUMULATE:
            assert self.full is not None
            self.grads = torch.zeros(self.bucket.padded_numel, dtype=self.reduce_dtype, device=self.full.device)
            if self.grad_views:
                for p, (off, stop, shape) in zip(self.params, self.views):
                    p.grad = self.grads[off:stop].view(shape)
        elif self.param_files is not None:
            # A new file each step: its blocks are reserved and read as zeros with no disk read.
            self.grad_shard = self.param_files.zeros(self.shard_end - self.shard_start, self.reduce_dtype)
        else:
            self.grad_shard = torch.zeros(self.shard_end - self.shard_start, dtype=self.reduce_dtype,
                                          device=self.master.device)

    def release_grads(self) -> None:
        """Drop the gradients once the update has used them (a collective still writing into a
        dropped buffer keeps it alive until it finishes and cannot touch the next step's)."""
        self.grads, self.grad_shard = None, None
        for p in self.params:
            p.grad = None
        if self.staging is not None and self._staging_pool is not None:
            self._staging_pool.release(self.staging)
        self.staging = None
        self.used = [False] * len(self.params)

    # -- gradients arriving during backward -----------------------------------------------------------
    def begin_micro_batch(self, *, active: bool) -> None:
        self.active, self.launched = active, False
        self.pending = len(self.params)
        self.arrived = [False] * len(self.params)

    def accept_grad(self, k: int, param: torch.Tensor) -> bool:
        """Take parameter ``k``'s gradient, just accumulated by backward (the reducer's
        post-accumulate-grad hook calls this). Returns whether it was the last gradient of this
        micro-batch the group waited for: its reduction may go."""
        self.used[k] = True
        accumulate = self.policy.grads is GradFlow.ACCUMULATE
        if accumulate and not self.grad_views:
            self._add_cast(k)  # every micro-batch: the flat buffer is in the reduce dtype
        if not self.active:
            return False  # accumulating (not the step's last micro-batch): autograd adds into the view
        if self.launched:
            raise ModelError(f"a gradient of {self.names[k]!r} arrived after its bucket was reduced: each parameter's "
                             "gradient must accumulate once per backward")
        if accumulate:
            if self.grad_views:
                self._fold(k)
        else:
            grad = param.grad
            if grad is None:
                return False
            off, stop, _ = self.views[k]
            staged = self._staging_buffer().tensor[off:stop]
            if self.arrived[k]:  # a second arrival in one backward adds to the first
                staged.add_(grad.reshape(-1))
            else:
                staged.copy_(grad.reshape(-1))
            param.grad = None
        if self.arrived[k]:
            return False
        self.arrived[k] = True
        self.pending -= 1
        return self.pending == 0

    def _add_cast(self, k: int) -> None:
        """Add a backward's ``.grad`` into the flat buffer in the reduce dtype and drop it."""
        assert self.grads is not None
        p = self.params[k]
        if p.grad is not None:
            off, stop, _ = self.views[k]
            self.grads[off:stop].add_(p.grad.reshape(-1))
            p.grad = None

    def _fold(self, k: int) -> None:
        """A ``.grad`` replaced rather than accumulated in place (e.g. ``zero_grad(set_to_none=True)``
        inside ``loss_fn``) is copied back into the flat buffer and the view restored."""
        assert self.grads is not None
        off, stop, shape = self.views[k]
        view = self.grads[off:stop].view(shape)
        p = self.params[k]
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    def check_grad_views(self) -> None:
        """After a micro-batch: every ``.grad`` of an ACCUMULATE group is its view again."""
        if self.grads is not None and self.policy.grads is GradFlow.ACCUMULATE and self.grad_views:
            for k in range(len(self.params)):
                if not self.arrived[k]:
                    self._fold(k)

    def _staging_buffer(self) -> PoolBuffer:
        if self.staging is None:
            assert self._staging_pool is not None
            self.staging = self._staging_pool.take(self.index, self.bucket.padded_numel)
        return self.staging

    # -- reduction --------------------------------------------------------------------------------
    def launch(self, stream: CommStream) -> None:
        """Submit this micro-batch's gradient reduction to ``stream`` (parameters that got no
        gradient contribute zeros)."""
        self.launched = True
        op = self.policy.label + "reduce_scatter"
        if self.policy.grads is GradFlow.ACCUMULATE:
            grads = self.grads
            assert grads is not None
            if self.policy.reduction is GradReduction.ALL_REDUCE:
                stream.submit(functools.partial(stream.all_reduce, grads))
            else:
                stream.submit(functools.partial(stream.reduce_scatter, grads, op=op))
            return
        staging = self._staging_buffer()
        buf = staging.tensor[:self.bucket.padded_numel]
        self._zero_gaps(buf)
        out, files = self.grad_shard, self.param_files
        assert out is not None

        def job() -> None:
            out.add_(stream.reduce_scatter(buf, op=op))
            if files is not None:
                files.evict(out)  # in its file until the update reads it

        staging.done = stream.submit(job)
        assert self._staging_pool is not None
        self._staging_pool.release(staging)
        self.staging = None

    def _zero_gaps(self, buf: torch.Tensor) -> None:
        """Zero what no gradient was copied over: the padding and parameters that got none
        this micro-batch (a reused buffer holds an earlier bucket's values)."""
        for k, (off, stop, _) in enumerate(self.views):
            if not self.arrived[k]:
                buf[off:stop].zero_()
        buf[self.bucket.numel:].zero_()

    def update_grad(self) -> torch.Tensor:
        """The reduced gradient over the update slice (compute dtype; a view)."""
        if self.grad_shard is not None:
            return self.grad_shard
        assert self.grads is not None
        return self.grads[self.update_start:self.update_end]

    # -- after the update -----------------------------------------------------------------------
    def publish(self, stream: CommStream) -> None:
        """Make the compute-dtype parameters agree with the master slice: copy, and all-gather
        where whole parameters were updated on shards (run with the stream idle)."""
        if self.owns_master:
            if self.policy.params is ParamResidency.PER_USE:
                assert self.shard is not None
                self.shard.copy_(self.master)
                if self.param_files is not None:
                    self.param_files.seal(self.shard)  # the next gathers check what they read against these
                    self.param_files.evict(self.shard)
                    self.param_files.evict(self.master)
            else:
                assert self.full is not None
                self.full[self.update_start:self.update_end].copy_(self.master)
        if self.policy.gather_after_update:
            assert self.full is not None
            stream.all_gather(self.full, op=self.policy.label + "all_gather")

    # -- gathered parameters (PER_USE) -----------------------------------------------------------
    def gather_into(self, region: torch.Tensor, stream: CommStream, *, op: str) -> None:
        """Fill ``region`` (this group's part of a pool buffer) with the whole parameters: runs on
        the stream's thread."""
        assert self.shard is not None
        full = region[:self.bucket.padded_numel]
        files = self.param_files
        if files is not None:  # read in and checked here, on the stream's thread, ahead of its unit
            files.populate(self.shard, write=False)
            files.verify(self.shard, what=f"the parameter shard of bucket {self.index}")
        full[self.shard_start:self.shard_end].copy_(self.shard)
        if files is not None:
            files.evict(self.shard)
        stream.all_gather(full, op=op)

    def attach(self, region: torch.Tensor) -> None:
        """Point the module's parameters into the gathered ``region``."""
        self.full = region[:self.bucket.padded_numel]
        for p, (off, stop, shape) in zip(self.params, self.views):
            p.data = self.full[off:stop].view(shape)

    def detach(self) -> None:
        """Free the gathered parameters: the module's parameters become empty placeholders."""
        self.full = None
        for p in self.params:
            p.data = self._empty

    # -- reports and state transfer -------------------------------------------------------------------
    def count(self, counter: StateCounter) -> None:
        """This group's model-state bytes (persistent groups apart, padding included)."""
        label = self.policy.label
        whole = self.policy.params is ParamResidency.WHOLE
        params = self.full if whole else self.shard
        assert params is not None
        real_shard = self.bucket.real_in_range(self.shard_start, self.shard_end)
        update_real = self.bucket.real_in_range(self.update_start, self.update_end)
        if label:
            counter.add_whole(label + "params", params)
            if self.grads is not None:
                counter.add_whole(label + "grads", self.grads)
        else:
            counter.add("params", params, self.bucket.numel if whole else real_shard)
            if self.grads is not None:
                counter.add("grads", self.grads, self.bucket.numel)
            if self.grad_shard is not None:
                counter.add("grads", self.grad_shard, real_shard)
        if self.owns_master:
            counter.add("optimizer_master", self.master, update_real)
        for t in self.moments.values():
            counter.add("optimizer_moments", t, update_real)
        filed = {t.data_ptr(): t for files, _, t in self._filed() if files.holds(t)}
        filed.update((t.data_ptr(), t) for t in self._param_tensors())
        for t in filed.values():
            counter.add_whole("nvme", t)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this group holds (storages are counted once by the caller)."""
        held = [t for t in (self.full, self.shard, self.master, self.grads, self.grad_shard) if t is not None]
        held += list(self.moments.values())
        held += [p.data for p in self.params] + [p.grad for p in self.params if p.grad is not None]
        return held

    def optimizer_slice(self) -> OptimizerSlice:
        return OptimizerSlice(bucket=self.bucket, start=self.update_start, end=self.update_end, master=self.master,
                              moments=self.moments)

    def master_fragments(self, layout: FlatLayout) -> dict[str, tuple[int, int, torch.Tensor]]:
        """This rank's fp32 weights: name -> (start, end, values) over the flattened parameter."""
        out: dict[str, tuple[int, int, torch.Tensor]] = {}
        for f in layout.fragments(self.bucket.index, self.update_start, self.update_end):
            name = layout.params[f.param].name
            out[name] = (f.param_start, f.param_end, self.master[f.local_start:f.local_end].float().cpu().clone())
        return out

