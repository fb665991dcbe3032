"""Stage-3 scheduling: gathering units' parameters for forward and backward, and freeing them.

A unit (``zero_ray.core.stage3_units``) is a module whose groups (its trainable and its frozen
parameters, one ``ParamGroup`` each) are all-gathered together into one buffer of a fixed pool
before its forward, and again before its backward:

- forward: the unit's pre-hook gathers it (the next units in the recorded execution order are
  gathered ahead, ``prefetch_depth``, on the comm stream while this one computes) and, when an
  input requires grad, threads the inputs through an identity autograd function whose backward
  marks the end of the unit's backward; the post-hook frees the parameters. The hooks sit on
  every entry module of the unit (``UnitSpec.entries``) and act on the outermost call only, so
  a unit whose own ``forward`` is bypassed (a wrapper whose parent calls its child directly) is
  entered by the first module under it that runs, before any of its parameters is read. A
  compiled unit keeps its own hooks only (``compiled``): identical blocks then share one graph.
- backward: a hook on the unit's outputs gathers it again (prefetching the next units in
  backward order) and queues its trainable group for reduction; when backward has passed the
  unit's inputs (or, for a unit one of whose entries had no input needing a gradient, when the
  micro-batch ends) its gradients are complete: the group is reduced and the parameters freed.
  Autograd's saved tensors that alias a gathered buffer are saved as (unit, view) handles, so
  backward reads the re-gathered values and a freed buffer can be reused at once.

Every decision that issues a collective (which unit to gather, prefetch or evict; when to
reduce) is taken on the compute thread at module-level events, the same on every rank whatever
its data (FSDP's requirement: every rank runs the same modules), so all ranks submit the same
collectives in the same order. Gathered memory is bounded by the pool, whatever the number of
units.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zero_ray.collective.stream import CommStream
from zero_ray.compat.torch_private import in_backward, tree_flatten, tree_unflatten
from zero_ray.config import Stage3Config
from zero_ray.core.stage3_units import UnitSpec
from zero_ray.errors import ModelError
from zero_ray.owner.tensors.buffers import BufferPool, PoolBuffer
from zero_ray.owner.step.rank_collectives import Fabric
from zero_ray.owner.step.param_group import ParamGroup
from zero_ray.owner.step.reducer import GradReducer

log = logging.getLogger(__name__)


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    SHARDED = "sharded"  # only this rank's shards exist; the module's parameters are placeholders
    GATHERING = "gathering"  # an all-gather into a pool buffer is queued on the comm stream
    GATHERED = "gathered"  # the full parameters are in the buffer; the module's parameters view it


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(kw_only=True)
class Unit:
    """One unit on this rank: its groups and where their parameters are."""

    spec: UnitSpec
    module: nn.Module
    groups: list[ParamGroup]  # the trainable group first, if any
    pool: BufferPool  # where it is gathered
    state: UnitState = UnitState.SHARDED
    buffer: PoolBuffer | None = None
    gathered: Future[Any] | None = None
    calls: int = 0  # calls of its entry modules in progress (the outermost one enters the unit)
    users: int = 0  # forward entries in progress
    in_backward: bool = False  # gathered for backward, backward not past it yet
    recomputed: bool = False  # gathered for activation checkpointing's recomputation, backward not past it
    done: bool = False  # its backward is over this micro-batch: gradients complete
    expected: int = 0  # end-of-backward signals to wait for this micro-batch (forward calls tracked)
    fired: int = 0
    # An entry this micro-batch had no input needing a gradient: nothing signals when backward
    # is past that call's parameters, so the unit ends with the micro-batch, whatever the others
    # signal (a unit entered twice, first from the data, then from computed activations).
    untracked: bool = False
    regions: list[tuple[int, int]] = field(default_factory=list)  # each group's part of the buffer

    def __post_init__(self) -> None:
        start = 0
        for g in self.groups:
            self.regions.append((start, start + g.bucket.padded_numel))
            start += g.bucket.padded_numel

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def numel(self) -> int:
        return self.regions[-1][1] if self.regions else 0

    @property
    def trainable(self) -> ParamGroup | None:
        return self.groups[0] if self.groups and self.groups[0].policy.trainable else None

    @property
    def gathered_bytes(self) -> int:
        return self.numel * self.groups[0].dtype.itemsize


def _recomputing() -> bool:
    """Whether a forward runs inside backward: activation checkpointing's recomputation (the
    only forward autograd runs while executing a graph)."""
    return in_backward()


def _as_views(args: Any, kwargs: Any) -> Any:
    """The inputs needing a gradient as views of themselves, as the forward's entering gave
    them (``_EndOfBackward`` returns its inputs, which autograd makes views): a compiled
    region guards on its inputs' bases when shapes are dynamic. None when there are none."""
    flat, spec = tree_flatten((args, kwargs))
    at = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not at:
        return None
    for k in at:
        flat[k] = flat[k].view_as(flat[k])
    return tree_unflatten(flat, spec)


class _EndOfBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once backward has passed the unit (every
    gradient of the unit's parameters accumulated: autograd runs accumulation first)."""

    @staticmethod
    def forward(ctx: Any, scheduler: UnitScheduler, unit: Unit, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.scheduler, ctx.unit = scheduler, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.scheduler._end_of_backward(ctx.unit)
        return (None, None, *grads)


@dataclass(frozen=True)
class _SavedView:
    """A tensor autograd saved that aliases a gathered buffer: re-read from the unit at backward."""

    unit: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the start of the unit's buffer


class UnitScheduler:
    """Gathers and frees one rank's units around forward and backward (module hooks)."""

    def __init__(self, units: list[Unit], *, root: nn.Module, config: Stage3Config, stream: CommStream,
                 reducer: GradReducer, pools: list[BufferPool], device: torch.device,
                 fabric: Fabric | None = None) -> None:
        self.units = units
        self.fabric = fabric  # how units are gathered (hpZ's secondary copies, qwZ); None: from the shards
        self.config = config
        self.stream = stream
        self.reducer = reducer
        self.pools = pools
        self.device = device
        self._order: dict[Pass, list[int]] = {p: [u.index for u in units] if p is Pass.FORWARD else [] for p in Pass}
        self._seen: dict[Pass, list[int]] = {p: [] for p in Pass}
        self._cursor: dict[Pass, int] = {p: 0 for p in Pass}
        self._live_bytes = 0
        self.peak_gathered_bytes = 0
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None
        self._entering: dict[str, list[Unit]] = {}  # entry module path -> the units it enters
        self._pool_at = {b.tensor.untyped_storage().data_ptr(): pool for pool in pools for b in pool.buffers}
        root.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        root.register_forward_hook(self._root_post_forward, always_call=True)
        entering = self._entering
        for u in units:
            if u.spec.path != "":
                for path in u.spec.entries or (u.spec.path,):
                    entering.setdefault(path, []).append(u)
        self._hooks: dict[str, list[torch.utils.hooks.RemovableHandle]] = {}
        for path, these in entering.items():
            these.sort(key=lambda u: u.spec.depth)  # enclosing units enter first and leave last
            module = root.get_submodule(path)
            self._hooks[path] = [
                module.register_forward_pre_hook(functools.partial(self._enter, these), with_kwargs=True),
                module.register_forward_hook(functools.partial(self._leave, these), always_call=True)]

    def compiled(self, paths: list[str]) -> None:
        """The units at ``paths`` have a compiled ``forward``: unhook the entry modules inside
        them. Dynamo guards on a traced hook's id, different in every block, so identical blocks
        would each compile a frame (torch's recompile_limit, 8, then runs the rest eagerly).
        Those hooks only count calls once the unit is entered, and a compiled unit is entered
        by its own forward (a parent bypassing it would bypass the compilation too)."""
        inside = tuple(f"{p}." for p in paths)
        for path, these in self._entering.items():
            if path.startswith(inside) and all(u.spec.path in paths and path.startswith(f"{u.spec.path}.")
                                               for u in these):
                for handle in self._hooks.pop(path, []):
                    handle.remove()

    # -- gathering ------------------------------------------------------------------------------------
    def _request(self, u: Unit, phase: Pass, *, prefetch: bool = False) -> bool:
        """Queue ``u``'s all-gather unless it is already gathered or queued. A prefetch only
        takes a free buffer; a demand evicts a prefetched unit if it must."""
        if u.state is not UnitState.SHARDED:
            return True
        buf = u.pool.acquire(u.index)
        if buf is None:
            if prefetch:
                return False
            buf = self._evict_for(u)
        u.buffer, u.state = buf, UnitState.GATHERING
        label = "all_gather_forward" if phase is Pass.FORWARD else "all_gather_backward"
        u.gathered = self.stream.submit(functools.partial(self._gather_job, u, buf.tensor, label))
        self._live_bytes += u.gathered_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._live_bytes)
        return True

    def _gather_job(self, u: Unit, buf: torch.Tensor, label: str) -> None:
        for g, (start, end) in zip(u.groups, u.regions):
            if self.fabric is None:
                g.gather_into(buf[start:end], self.stream, op=label)
            else:
                self.fabric.gather(g, buf[start:end], self.stream, backward=label == "all_gather_backward", op=label)

    def _wait(self, u: Unit) -> None:
        if u.state is UnitState.GATHERING:
            assert u.gathered is not None and u.buffer is not None
            u.gathered.result()
            for g, (start, end) in zip(u.groups, u.regions):
                g.attach(u.buffer.tensor[start:end])
            u.state = UnitState.GATHERED

    def _release(self, u: Unit) -> None:
        if u.state is UnitState.SHARDED:
            return
        for g in u.groups:
            g.detach()
        assert u.buffer is not None
        u.pool.release(u.buffer)
        u.buffer, u.gathered, u.state = None, None, UnitState.SHARDED
        self._live_bytes -= u.gathered_bytes

    def _evict_for(self, u: Unit) -> PoolBuffer:
        for v in self.units:
            if (v is not u and v.pool is u.pool and v.state is not UnitState.SHARDED
                    and v.users == 0 and not v.in_backward and not v.recomputed):
                self._release(v)  # prefetched but not started: its gather is simply overwritten
                buf = u.pool.acquire(u.index)
                assert buf is not None
                return buf
        held = [self.units[i].spec.path for i in u.pool.holders()]
        raise ModelError(f"unit {u.spec.path!r} needs a gathered buffer but all {u.pool.count} are in "
                         f"use by units {held}; raise Stage3Config.max_live_units")

    def _prefetch(self, phase: Pass, u: Unit) -> None:
        depth = self.config.prefetch_depth
        order = self._order[phase]
        if depth == 0 or not order:
            return
        try:
            pos = order.index(u.index, self._cursor[phase])
        except ValueError:
            return  # this pass departs from the recorded order: no guess
        self._cursor[phase] = pos + 1
        for v in order[pos + 1:pos + 1 + depth]:
            if not self._request(self.units[v], phase, prefetch=True):
                break

    # -- forward hooks --------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._saving is None:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving.__enter__()
        root = self._root_unit()
        return self._unit_pre_forward(root, module, args, kwargs) if root is not None else None

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        try:
            root = self._root_unit()
            if root is not None:
                self._unit_post_forward(root, module, args, output)
            self._end_of_forward()
        finally:
            if self._saving is not None:
                self._saving.__exit__(None, None, None)
                self._saving = None

    def _root_unit(self) -> Unit | None:
        return self.units[0] if self.units and self.units[0].spec.path == "" else None

    def _enter(self, units: list[Unit], module: nn.Module, args: Any, kwargs: Any) -> Any:
        """An entry module of ``units`` begins its forward: enter each unit none of whose entry
        modules is running yet; calls nested inside the entering one are only counted."""
        changed = None
        for u in units:
            u.calls += 1
            if u.calls == 1:
                threaded = self._unit_pre_forward(u, module, args, kwargs)
                if threaded is not None:
                    changed = args, kwargs = threaded
        return changed

    def _leave(self, units: list[Unit], module: nn.Module, args: Any, output: Any) -> None:
        for u in reversed(units):
            if u.calls == 0:
                continue  # an error in the pre-hooks before this unit was entered
            u.calls -= 1
            if u.calls == 0:
                self._unit_post_forward(u, module, args, output)

    def recompute(self, path: str, module: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        """Activation checkpointing's recomputation of the module at ``path``: its ``forward`` is
        called again without its module hooks, so run the unit's enter and leave around it as
        its forward did: the parameters are gathered, and a compiled unit sees its inputs as the
        views the entering made (given plain inputs it would recompile and save other tensors:
        torch's CheckpointError, "Recomputed values ... have different metadata")."""
        these = self._entering.get(path)
        if not these or not _recomputing():
            return forward(*args, **kwargs)
        threaded = self._enter(these, module, args, kwargs)
        if threaded is not None:
            args, kwargs = threaded
        try:
            return forward(*args, **kwargs)
        finally:
            self._leave(these, module, args, None)

    def _unit_pre_forward(self, u: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if _recomputing():
            # A unit inside a checkpointed one, run again by backward's recomputation: it needs
            # its parameters, kept until its backward is over (the recomputed tensors autograd
            # holds view them); its backward was set up by the real forward.
            self._request(u, Pass.BACKWARD)
            self._wait(u)
            u.recomputed = True
            return _as_views(args, kwargs)
        self._seen[Pass.FORWARD].append(u.index)
        u.users += 1
        self._request(u, Pass.FORWARD)
        self._prefetch(Pass.FORWARD, u)
        self._wait(u)
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        at = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            u.untracked = True
            return None
        u.expected += 1
        for k, t in zip(at, _EndOfBackward.apply(self, u, *(flat[k] for k in at))):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def _unit_post_forward(self, u: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if _recomputing():
            return  # freed when its backward completes, like any unit gathered for backward
        if torch.is_grad_enabled() and output is not None:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._output_grad_hook, u))
        u.users = max(0, u.users - 1)
        if u.users == 0 and not u.in_backward:
            self._release(u)

    def _end_of_forward(self) -> None:
        for v in self.units:  # prefetched for a forward that went another way
            if v.users == 0 and not v.in_backward:
                self._release(v)
        if not torch.is_grad_enabled():
            return
        if not self._order[Pass.BACKWARD]:
            # First micro-batch: backward starts at the model's output (the root), then runs
            # the forward order in reverse.
            root = self._root_unit()
            rest = [i for i in reversed(self._seen[Pass.FORWARD]) if root is None or i != root.index]
            self._order[Pass.BACKWARD] = ([root.index] if root is not None else []) + rest
        for v in self._order[Pass.BACKWARD][:self.config.prefetch_depth]:
            if not self._request(self.units[v], Pass.BACKWARD, prefetch=True):
                break

    # -- backward -------------------------------------------------------------------------------------
    def _output_grad_hook(self, u: Unit, grad: torch.Tensor) -> None:
        self._begin_backward(u)

    def _begin_backward(self, u: Unit) -> None:
        if u.in_backward or u.done:
            return
        u.in_backward = True
        self._seen[Pass.BACKWARD].append(u.index)
        group = u.trainable
        if group is not None:
            self.reducer.enqueue(group, before=self._enclosing_trainable(u))
        self._request(u, Pass.BACKWARD)
        self._prefetch(Pass.BACKWARD, u)
        self._wait(u)

    def _enclosing_trainable(self, u: Unit) -> ParamGroup | None:
        parent = u.spec.parent
        while parent is not None:
            group = self.units[parent].trainable
            if group is not None:
                return group
            parent = self.units[parent].spec.parent
        return None

    def _end_of_backward(self, u: Unit) -> None:
        u.fired += 1
        if u.fired >= u.expected and not u.untracked:
            self._complete(u)

    def _complete(self, u: Unit) -> None:
        """Backward is past ``u``: reduce its gradients and free its parameters."""
        if u.done:
            return
        u.done, u.in_backward, u.recomputed = True, False, False
        group = u.trainable
        if group is not None:
            self.reducer.unit_done(group)
        if u.users == 0:
            self._release(u)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.layout is not torch.strided:
            return t
        pool = self._pool_at.get(t.untyped_storage().data_ptr())
        buf = pool.buffer_of(t) if pool is not None else None
        if buf is None or buf.holder is None:
            return t
        # The offset within the unit's buffer: backward may find the unit gathered into another
        # buffer of the pool (another part of the same storage).
        return _SavedView(unit=buf.holder, size=tuple(t.shape), stride=tuple(t.stride()),
                          offset=t.storage_offset() - buf.tensor.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        u = self.units[saved.unit]
        if u.state is not UnitState.GATHERED:
            if u.done:  # read after its backward ended: gathered until the micro-batch ends
                self._request(u, Pass.BACKWARD)
                self._wait(u)
            else:
                self._begin_backward(u)
        assert u.buffer is not None
        buf = u.buffer.tensor
        return buf.as_strided(saved.size, saved.stride, buf.storage_offset() + saved.offset)

    # -- the micro-batch ------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        if self.fabric is not None:
            self.fabric.forget()  # forward gathers afresh (and refills hpZ's copies)
        for phase in Pass:
            if self._seen[phase]:
                self._order[phase] = self._seen[phase]
            self._seen[phase] = []
            self._cursor[phase] = 0
        for u in self.units:
            u.in_backward, u.done, u.recomputed, u.expected, u.fired, u.untracked = False, False, False, 0, 0, False

    def end_micro_batch(self) -> None:
        """Units whose backward never signalled its end (inputs that need no gradient) are
        complete now, in index order: every rank reduces every unit."""
        for u in self.units:
            self._complete(u)
        for u in self.units:
            self._release(u)

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        """A forward outside training (evaluation): its units are gathered and freed as usual,
        and the execution order recorded for training's prefetch is left as it was."""
        seen = {p: list(v) for p, v in self._seen.items()}
        cursor = dict(self._cursor)
        self._seen[Pass.FORWARD], self._cursor[Pass.FORWARD] = [], 0
        try:
            yield
        finally:
            for u in self.units:
                self._release(u)
            self._seen, self._cursor = seen, cursor

    def discard(self) -> None:
        """Forget an interrupted micro-batch: wait out queued collectives, free every buffer."""
        self.stream.drain_quietly()
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        for u in self.units:
            self._release(u)
            u.users, u.in_backward, u.done, u.recomputed, u.expected, u.fired = 0, False, False, False, 0, 0
            u.calls, u.untracked = 0, False
        for pool in self.pools:
            pool.reset()
        self._live_bytes = 0
