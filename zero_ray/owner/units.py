"""Stage 3 (P_os+g+p): a rank holds only its shard of every unit's parameters.

Per unit (``zero_ray.core.units``; one flat layout bucket each) a rank holds its slice of the
fp32 master weights, the same slice in the compute dtype (the master itself in fp32 training),
the reduced gradient of that slice and the optimizer moments. The module's parameters are empty
placeholders except while their unit is gathered:

- forward: a unit's forward pre-hook all-gathers its parameters into a buffer of a fixed pool
  and points the parameters into it; the post-hook frees them. The next units in the recorded
  execution order are gathered ahead (``prefetch_depth``) on the comm stream while this one
  computes.
- backward: a hook on the unit's forward outputs gathers it again before its backward runs
  (prefetching the next units in backward order); each parameter's post-accumulate-grad hook
  copies its gradient into a reduce buffer, and once the unit's last gradient is in, the buffer
  is reduce-scattered into the gradient shard (on the comm stream) and the parameters are freed.
  Autograd's saved tensors that alias a gathered buffer are saved as (unit, view) handles, so
  backward reads the re-gathered values and a freed buffer can be reused at once.
- update: the optimizer steps each unit's master shard (``core.optim``); the compute shard is
  refreshed from it. Nothing is gathered after the update: the next forward gathers.

Persistent parameters (below ``persistence_threshold``) stay whole on every rank: their
gradients accumulate in a replicated buffer, are reduce-scattered once per step, and the updated
shards are all-gathered, as stage 2 does.

Every decision that issues a collective (which unit to gather, prefetch or evict; when to
reduce) is made on the compute thread from state every rank shares, so all ranks submit the
same collectives in the same order. Buffers are pooled: gathered memory is bounded by the pool,
whatever the number of units.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import os
import socket
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zero_ray.collective.group import Collective
from zero_ray.collective.stream import CommStream
from zero_ray.config import Stage3Config
from zero_ray.core.layout import Bucket, FlatLayout
from zero_ray.core.optim import takes_weight_decay
from zero_ray.core.units import ModuleInfo, UnitPlan, UnitSpec, plan_units
from zero_ray.errors import CheckpointError, ConfigError, ModelError
from zero_ray.owner.accounting import StateBytes
from zero_ray.owner.engine import (
    EngineSpec,
    OptimizerSlice,
    build_module,
    cast_buffers,
    check_module,
    param_specs,
)
from zero_ray.owner.materialize import InitRecorder, build_recorded
from zero_ray.owner.shard import _merge

log = logging.getLogger(__name__)


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    SHARDED = "sharded"  # only this rank's shard exists; the module's parameters are placeholders
    GATHERING = "gathering"  # an all-gather into a pool buffer is queued on the comm stream
    GATHERED = "gathered"  # the full parameters are in the buffer; the module's parameters view it


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


# -- module description -----------------------------------------------------------------------------
def describe_modules(module: nn.Module) -> tuple[list[ModuleInfo], list[list[str]], list[list[str]]]:
    """``module`` as the planner sees it: ModuleInfo per module, and per distinct parameter the
    module paths and the full names (aliases first-registered first) that register it."""
    named = list(module.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    sites: list[list[str]] = [[] for _ in named]
    names: list[list[str]] = [[] for _ in named]
    for full, p in module.named_parameters(remove_duplicate=False):
        sites[index[id(p)]].append(full.rpartition(".")[0])
        names[index[id(p)]].append(full)
    # Elements under each module path: every distinct parameter counted once per ancestor of
    # any of its registrations (linear in parameters x depth, not modules x parameters).
    numel: Counter[str] = Counter()
    for (_, p), where in zip(named, sites):
        ancestors = {""}
        for path in where:
            parts = path.split(".") if path else []
            ancestors.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
        for a in ancestors:
            numel[a] += p.numel()
    infos: list[ModuleInfo] = []
    for path, m in module.named_modules():
        own = tuple(dict.fromkeys(index[id(p)] for p in m._parameters.values() if p is not None))
        classes = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(m).__mro__ if issubclass(c, nn.Module))
        infos.append(ModuleInfo(path=path, classes=classes, params=own, numel=numel[path]))
    return infos, sites, names


# -- where initial values come from -----------------------------------------------------------------
class ParamSource(Protocol):
    """Initial parameter values, one flattened range at a time (fp32, on the host)."""

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor: ...

    def buffer(self, name: str) -> torch.Tensor | None: ...


class ModuleSource:
    """The parameters of a module built whole on the host (init="full")."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        return self._params[index].detach().reshape(-1)[start:end].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        return None


class RecipeSource:
    """Recorded initialisations, materialised one parameter at a time (init="low_memory")."""

    def __init__(self, recorder: InitRecorder, params: Sequence[torch.Tensor]) -> None:
        self._recorder = recorder
        self._params = list(params)
        self._index = -1
        self._value: torch.Tensor | None = None

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        if index != self._index:
            self._value = None  # release the previous parameter before building the next
            self._value = self._recorder.recipe_for(self._params[index]).materialize().reshape(-1)
            self._index = index
        assert self._value is not None
        return self._value[start:end].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        return None


class StateDictSource:
    """A ``{name: tensor}`` dict or a safetensors file; a file is read a slice at a time."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, Any], *, names: Sequence[Sequence[str]],
                 shapes: Sequence[tuple[int, ...]]) -> None:
        self._dict: Mapping[str, Any] | None = None
        self._file: Any = None
        if isinstance(source, Mapping):
            self._dict = source
            keys = set(source)
        else:
            from safetensors import safe_open

            try:
                self._file = safe_open(os.fspath(source), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own types for bad headers
                raise CheckpointError(f"cannot read {os.fspath(source)!r} as safetensors: {err}") from err
            keys = set(self._file.keys())
        self._keys: list[str] = []
        missing: list[str] = []
        for aliases in names:
            found = next((n for n in aliases if n in keys), None)
            self._keys.append(found or "")
            if found is None:
                missing.append(aliases[0])
        if missing:
            raise CheckpointError(f"init_state_dict has no value for parameters {missing}")
        wrong = [(k, tuple(self._shape(k)), tuple(s)) for k, s in zip(self._keys, shapes) if tuple(self._shape(k)) != tuple(s)]
        if wrong:
            raise CheckpointError(f"init_state_dict shapes differ from the model's (name, file, model): {wrong}")
        self._buffer_keys = keys

    def _shape(self, key: str) -> tuple[int, ...]:
        if self._dict is not None:
            return tuple(self._dict[key].shape)
        return tuple(self._file.get_slice(key).get_shape())

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        key = self._keys[index]
        if self._dict is not None:
            return torch.as_tensor(self._dict[key]).detach().reshape(-1)[start:end].float()
        shape = self._shape(key)
        if len(shape) == 0:
            return self._file.get_tensor(key).reshape(-1)[start:end].float()
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)  # read only the rows that hold [start, end)
        rows = self._file.get_slice(key)[first:last]
        return rows.reshape(-1)[start - first * row:end - first * row].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        if name not in self._buffer_keys:
            return None
        return torch.as_tensor(self._dict[name]) if self._dict is not None else self._file.get_tensor(name)


# -- buffers ------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class PoolBuffer:
    """One reusable flat buffer: a gathered unit's parameters, or its gradients before the
    reduce-scatter. ``unit`` is the logical owner (decided on the compute thread); ``done`` is
    the last collective reading it, which a new owner waits for before writing."""

    index: int
    tensor: torch.Tensor
    unit: int | None = None
    done: Future[Any] | None = None


class BufferPool:
    """``count`` buffers of ``numel`` elements. The lowest free buffer is always taken, so every
    rank makes the same choices."""

    def __init__(self, *, name: str, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.buffers = [PoolBuffer(index=i, tensor=torch.zeros(numel, dtype=dtype, device=device))
                        for i in range(count)]
        self.numel = numel
        self._dtype, self._device = dtype, device
        self.overflow_peak = 0  # bytes of temporary buffers taken when the pool was exhausted

    def acquire(self, unit: int) -> PoolBuffer | None:
        for buf in self.buffers:
            if buf.unit is None:
                buf.unit = unit
                return buf
        return None

    def temporary(self, unit: int, numel: int) -> PoolBuffer:
        buf = PoolBuffer(index=-1, tensor=torch.zeros(numel, dtype=self._dtype, device=self._device), unit=unit)
        self.overflow_peak = max(self.overflow_peak, buf.tensor.numel() * buf.tensor.element_size())
        return buf

    def release(self, buf: PoolBuffer) -> None:
        buf.unit = None

    def holders(self) -> list[int]:
        return [b.unit for b in self.buffers if b.unit is not None]

    @property
    def nbytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self.buffers)


# -- per-unit state ----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Unit:
    """One unit on this rank: its shard of the model state and where its parameters are."""

    spec: UnitSpec
    bucket: Bucket
    module: nn.Module
    params: list[nn.Parameter] = field(repr=False)
    views: list[tuple[int, int, tuple[int, ...]]]  # per parameter: offset, end, shape in the bucket
    master: torch.Tensor  # fp32 weights of this rank's slice
    shard: torch.Tensor  # the same slice in the compute dtype (``master`` itself in fp32)
    grad_shard: torch.Tensor  # reduced gradient of the slice, accumulated over micro-batches
    moments: dict[str, torch.Tensor]
    decay: list[tuple[int, int]]
    gather_pool: BufferPool
    reduce_pool: BufferPool
    state: UnitState = UnitState.SHARDED
    buffer: PoolBuffer | None = None
    gathered: Future[Any] | None = None
    users: int = 0  # forward calls in progress
    in_backward: bool = False  # gathered for backward, gradients not all reduced yet
    pending: int = 0  # parameters whose gradient has not arrived this micro-batch
    staging: PoolBuffer | None = None
    reduced: bool = False  # reduce-scatter queued this micro-batch

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def gathered_bytes(self) -> int:
        return self.bucket.padded_numel * self.shard.element_size()


@dataclass(kw_only=True)
class PersistentParams:
    """Parameters kept whole on every rank: a replicated buffer and its gradient buffer, the
    module's parameters being views of them; master and moments over this rank's slice."""

    bucket: Bucket
    params: list[nn.Parameter] = field(repr=False)
    views: list[tuple[int, int, tuple[int, ...]]]
    full: torch.Tensor
    grads: torch.Tensor
    master: torch.Tensor
    master_is_view: bool
    moments: dict[str, torch.Tensor]
    decay: list[tuple[int, int]]
    start: int
    end: int

    def check_grad_views(self) -> None:
        """Gradients accumulate in place into ``grads``; a replaced ``.grad`` is folded back."""
        for p, (off, end, shape) in zip(self.params, self.views):
            view = self.grads[off:end].view(shape)
            g = p.grad
            if g is None or g.data_ptr() != view.data_ptr():
                if g is not None:
                    view.copy_(g)
                p.grad = view


@dataclass(frozen=True)
class _SavedView:
    """A tensor autograd saved that aliases a gathered buffer: re-read from the unit at backward."""

    unit: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def node_turn(group: Collective, rank: int) -> tuple[int, int]:
    """This rank's turn among the ranks on its host, and the most ranks any host has: ranks
    build the full model one per host at a time, so a host never holds two full copies."""
    n = group.world_size
    values = [0.0] * n
    values[rank] = float(zlib.crc32(socket.gethostname().encode()))  # < 2**32: exact in float64
    hosts = group.all_reduce_values(values) if n > 1 else values
    turn = sum(1 for r in range(rank) if hosts[r] == hosts[rank])
    return turn, max(Counter(hosts).values())


class PartitionedParams:
    """Stage 3's model state on one rank (the ``ModelState`` of partitioned parameters)."""

    def __init__(self, spec: EngineSpec, *, rank: int, group: Collective, device: torch.device) -> None:
        self.spec = spec
        self.config: Stage3Config = spec.stage3
        self.rank = rank
        self.group = group
        self.dtype = spec.compute_dtype
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self.device = self._empty.device  # with its index ("cuda:0"), as tensors report it
        self.units: list[Unit] = []
        self.persistent: PersistentParams | None = None
        self.plan: UnitPlan
        self.layout: FlatLayout
        self.module: nn.Module
        self._order: dict[Pass, list[int]] = {p: [] for p in Pass}
        self._seen: dict[Pass, list[int]] = {p: [] for p in Pass}
        self._cursor: dict[Pass, int] = {p: 0 for p in Pass}
        self._live_bytes = 0
        self.peak_gathered_bytes = 0
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None
        self._buffer_at: dict[int, PoolBuffer] = {}
        self._construct(spec, group)
        self._install_hooks()
        self.stream = CommStream(group)

    # -- construction ---------------------------------------------------------------------------------
    def _construct(self, spec: EngineSpec, group: Collective) -> None:
        cfg = self.config
        if spec.init_state_dict is not None:
            module, _ = build_recorded(spec.model_fn, seed=spec.seed, record=False)
            module = check_module(module)
            _, _, names = describe_modules(module)
            shapes = [tuple(p.shape) for p in module.parameters()]
            source: ParamSource = StateDictSource(spec.init_state_dict, names=names, shapes=shapes)
            self._bind(module, source)
        elif cfg.init == "low_memory":
            module, recorder = build_recorded(spec.model_fn, seed=spec.seed)
            module = check_module(module)
            self._bind(module, RecipeSource(recorder, list(module.parameters())))
        else:
            turn, turns = node_turn(group, self.rank)
            for t in range(turns):
                if t == turn:
                    module = build_module(spec)  # on the host; only the shard moves to the device
                    self._bind(module, ModuleSource(list(module.parameters())))
                    del module
                group.barrier()

    def _bind(self, module: nn.Module, source: ParamSource) -> None:
        """Plan units, take this rank's shards from ``source`` unit by unit, and replace the
        module's parameters with placeholders (views for persistent ones)."""
        cfg, spec, rank = self.config, self.spec, self.rank
        n = self.group.world_size
        infos, sites, names = describe_modules(module)
        named = list(module.named_parameters())
        self.plan = plan_units(infos, [p.numel() for _, p in named], policy=cfg.wrap_policy,
                               persistence_threshold=cfg.persistence_threshold, sites=sites)
        self.layout = layout = FlatLayout.build(param_specs(module), world_size=n, groups=self.plan.groups())
        dev, fp32 = self.device, torch.float32
        new_params: list[nn.Parameter] = [nn.Parameter(self._empty.clone()) for _ in named]

        def decay_ranges(bucket: Bucket, start: int, end: int) -> list[tuple[int, int]]:
            return _merge([(f.local_start, f.local_end) for f in layout.fragments(bucket.index, start, end)
                           if takes_weight_decay(layout.params[f.param].name, layout.params[f.param].shape,
                                                 spec.optimizer.no_decay)])

        def views(bucket: Bucket) -> list[tuple[int, int, tuple[int, ...]]]:
            return [(layout.params[i].offset, layout.params[i].end, layout.params[i].shape) for i in bucket.params]

        unit_buckets = [layout.buckets[u.index] for u in self.plan.units]
        root = next((u for u in self.plan.units if u.path == ""), None)
        nonroot = [u for u in self.plan.units if u.path != ""]
        depth_of = {u.index: u.depth - (1 if root is not None else 0) for u in nonroot}
        nesting = 1 + max(depth_of.values(), default=-1)
        count = cfg.max_live_units if cfg.max_live_units is not None else nesting + cfg.prefetch_depth + 1
        if nonroot and count < nesting:
            raise ConfigError(f"max_live_units={count} is below the unit nesting depth {nesting}: nested units "
                              "are gathered together; raise max_live_units")
        shared_numel = max((layout.buckets[u.index].padded_numel for u in nonroot), default=0)
        gather = BufferPool(name="gather", count=count if nonroot else 0, numel=shared_numel, dtype=self.dtype, device=dev)
        reduce = BufferPool(name="reduce", count=count if nonroot else 0, numel=shared_numel, dtype=self.dtype, device=dev)
        self.pools: list[BufferPool] = [gather, reduce]
        root_pools: tuple[BufferPool, BufferPool] | None = None
        if root is not None:
            # The root is live for the whole forward and backward: it gets its own buffers, so
            # the shared ones are sized by the largest non-root unit.
            numel = layout.buckets[root.index].padded_numel
            root_pools = (BufferPool(name="root_gather", count=1, numel=numel, dtype=self.dtype, device=dev),
                          BufferPool(name="root_reduce", count=1, numel=numel, dtype=self.dtype, device=dev))
            self.pools += list(root_pools)

        for u, bucket in zip(self.plan.units, unit_buckets):
            start, end = bucket.shard_range(rank)
            master = torch.zeros(end - start, dtype=fp32, device=dev)
            for f in layout.fragments(bucket.index, start, end):
                master[f.local_start:f.local_end] = source.fragment(f.param, f.param_start, f.param_end).to(dev)
            pools = root_pools if u.path == "" and root_pools is not None else (gather, reduce)
            self.units.append(Unit(
                spec=u, bucket=bucket, module=module.get_submodule(u.path), params=[new_params[i] for i in bucket.params],
                views=views(bucket), master=master, shard=master if self.dtype == fp32 else master.to(self.dtype),
                grad_shard=torch.zeros(end - start, dtype=self.dtype, device=dev),
                moments={k: torch.zeros(end - start, dtype=fp32, device=dev) for k in spec.optimizer.state_names},
                decay=decay_ranges(bucket, start, end), gather_pool=pools[0], reduce_pool=pools[1]))

        pb = self.plan.persistent_bucket
        if pb is not None:
            bucket = layout.buckets[pb]
            start, end = bucket.shard_range(rank)
            full32 = torch.zeros(bucket.padded_numel, dtype=fp32, device=dev)
            for i in bucket.params:
                p = layout.params[i]
                full32[p.offset:p.end] = source.fragment(i, 0, p.numel).to(dev)
            full = full32 if self.dtype == fp32 else full32.to(self.dtype)
            grads = torch.zeros(bucket.padded_numel, dtype=self.dtype, device=dev)
            pviews = views(bucket)
            for i, (off, stop, shape) in zip(bucket.params, pviews):
                new_params[i].data = full[off:stop].view(shape)
                new_params[i].grad = grads[off:stop].view(shape)
            master_is_view = self.dtype == fp32
            self.persistent = PersistentParams(
                bucket=bucket, params=[new_params[i] for i in bucket.params], views=pviews, full=full, grads=grads,
                master=full[start:end] if master_is_view else full32[start:end].clone(), master_is_view=master_is_view,
                moments={k: torch.zeros(end - start, dtype=fp32, device=dev) for k in spec.optimizer.state_names},
                decay=decay_ranges(bucket, start, end), start=start, end=end)
            del full32

        for aliases, new in zip(names, new_params):
            for full_name in aliases:
                owner, _, attr = full_name.rpartition(".")
                module.get_submodule(owner)._parameters[attr] = new
        for name, buf in module.named_buffers():
            value = source.buffer(name)
            if value is not None:
                with torch.no_grad():
                    buf.copy_(value)
        module.to(self.device)
        cast_buffers(module, self.dtype)
        self.module = module
        for pool in self.pools:
            for b in pool.buffers:
                self._buffer_at[b.tensor.untyped_storage().data_ptr()] = b
        self._order[Pass.FORWARD] = [u.index for u in self.units]  # module order: a first guess

    def _install_hooks(self) -> None:
        self.module.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        self.module.register_forward_hook(self._root_post_forward, always_call=True)
        for u in self.units:
            if u.spec.path != "":
                u.module.register_forward_pre_hook(functools.partial(self._unit_pre_forward, u))
                u.module.register_forward_hook(functools.partial(self._unit_post_forward, u), always_call=True)
            for k, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, k))

    # -- gathering ------------------------------------------------------------------------------------
    def _request(self, u: Unit, phase: Pass, *, prefetch: bool = False) -> bool:
        """Queue ``u``'s all-gather unless it is already gathered or queued. A prefetch only
        takes a free buffer; a demand evicts a prefetched unit if it must."""
        if u.state is not UnitState.SHARDED:
            return True
        buf = u.gather_pool.acquire(u.index)
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
        full = buf[:u.bucket.padded_numel]
        start, end = u.bucket.shard_range(self.rank)
        full[start:end].copy_(u.shard)
        self.stream.all_gather(full, op=label)

    def _wait(self, u: Unit) -> None:
        if u.state is UnitState.GATHERING:
            assert u.gathered is not None and u.buffer is not None
            u.gathered.result()
            buf = u.buffer.tensor
            for p, (off, end, shape) in zip(u.params, u.views):
                p.data = buf[off:end].view(shape)
            u.state = UnitState.GATHERED

    def _release(self, u: Unit) -> None:
        if u.state is UnitState.SHARDED:
            return
        for p in u.params:
            p.data = self._empty
        assert u.buffer is not None
        u.gather_pool.release(u.buffer)
        u.buffer, u.gathered, u.state = None, None, UnitState.SHARDED
        self._live_bytes -= u.gathered_bytes

    def _evict_for(self, u: Unit) -> PoolBuffer:
        for v in self.units:
            if (v is not u and v.gather_pool is u.gather_pool and v.state is not UnitState.SHARDED
                    and v.users == 0 and not v.in_backward):
                self._release(v)  # prefetched but not started: its gather is simply overwritten
                buf = u.gather_pool.acquire(u.index)
                assert buf is not None
                return buf
        held = [self.units[i].spec.path for i in u.gather_pool.holders()]
        raise ModelError(f"unit {u.spec.path!r} needs a gathered buffer but all {len(u.gather_pool.buffers)} are in "
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
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._saving is None:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving.__enter__()
        root = self._root_unit()
        if root is not None:
            self._unit_pre_forward(root, module, args)

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

    def _unit_pre_forward(self, u: Unit, module: nn.Module, args: Any) -> None:
        self._seen[Pass.FORWARD].append(u.index)
        u.users += 1
        self._request(u, Pass.FORWARD)
        self._prefetch(Pass.FORWARD, u)
        self._wait(u)

    def _unit_post_forward(self, u: Unit, module: nn.Module, args: Any, output: Any) -> None:
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
        self._pre_backward(u)

    def _pre_backward(self, u: Unit) -> None:
        if u.in_backward or u.reduced:
            return
        u.in_backward = True
        self._seen[Pass.BACKWARD].append(u.index)
        self._request(u, Pass.BACKWARD)
        self._prefetch(Pass.BACKWARD, u)
        self._wait(u)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.layout is not torch.strided:
            return t
        buf = self._buffer_at.get(t.untyped_storage().data_ptr())
        if buf is None or buf.unit is None:
            return t
        return _SavedView(unit=buf.unit, size=tuple(t.shape), stride=tuple(t.stride()), offset=t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        u = self.units[saved.unit]
        if u.state is not UnitState.GATHERED:
            if u.reduced:  # read after its gradients were reduced: gathered until the micro-batch ends
                self._request(u, Pass.BACKWARD)
                self._wait(u)
            else:
                self._pre_backward(u)
        assert u.buffer is not None
        return u.buffer.tensor.as_strided(saved.size, saved.stride, saved.offset)

    def _on_grad(self, u: Unit, k: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if u.reduced:
            raise ModelError(f"a gradient of unit {u.spec.path!r} arrived after the unit was reduced")
        off, end, _ = u.views[k]
        self._staging(u).tensor[off:end].copy_(grad.reshape(-1))
        u.pending -= 1
        if u.pending == 0:
            self._reduce(u)

    def _staging(self, u: Unit) -> PoolBuffer:
        if u.staging is None:
            buf = u.reduce_pool.acquire(u.index)
            if buf is None:
                log.warning("stage 3: reduce buffers exhausted at unit %r; using a temporary one", u.spec.path)
                buf = u.reduce_pool.temporary(u.index, u.bucket.padded_numel)
            if buf.done is not None:
                buf.done.result()  # the previous reduce-scatter from this buffer has finished
                buf.done = None
            buf.tensor[:u.bucket.padded_numel].zero_()
            u.staging = buf
        return u.staging

    def _reduce(self, u: Unit) -> None:
        buf = self._staging(u)
        padded = u.bucket.padded_numel

        def job() -> None:
            u.grad_shard.add_(self.stream.reduce_scatter(buf.tensor[:padded], op="reduce_scatter"))

        buf.done = self.stream.submit(job)
        u.reduce_pool.release(buf)
        u.staging, u.reduced, u.in_backward = None, True, False
        if u.users == 0:
            self._release(u)

    # -- the step's protocol (engine.ModelState) --------------------------------------------------------
    def begin_micro_batch(self) -> None:
        for phase in Pass:
            if self._seen[phase]:
                self._order[phase] = self._seen[phase]
            self._seen[phase] = []
            self._cursor[phase] = 0
        for u in self.units:
            u.pending, u.reduced, u.in_backward = len(u.params), False, False

    def end_micro_batch(self, *, last: bool) -> None:
        # Units whose gradients did not all arrive (parameters unused this micro-batch) are
        # reduced now, in index order, zeros included: every rank reduces every unit.
        for u in self.units:
            if not u.reduced:
                self._reduce(u)
        for u in self.units:
            self._release(u)
        p = self.persistent
        if last and p is not None:
            p.check_grad_views()
            self.stream.submit(lambda: self.stream.reduce_scatter(p.grads, op="persistent_reduce_scatter"))
        self.stream.drain()  # the step's update runs with the stream idle

    def update_grads(self) -> list[torch.Tensor]:
        grads = [u.grad_shard for u in self.units]
        if self.persistent is not None:
            grads.append(self.persistent.grads[self.persistent.start:self.persistent.end])
        return grads

    def apply_update(self, grads: list[torch.Tensor], *, step: int, lr: float) -> None:
        opt = self.spec.optimizer
        for u, g in zip(self.units, grads):
            opt.update(u.master, g, u.moments, step=step, lr=lr, decay=u.decay)
            if u.shard is not u.master:
                u.shard.copy_(u.master)
        p = self.persistent
        if p is not None:
            opt.update(p.master, grads[-1], p.moments, step=step, lr=lr, decay=p.decay)
            self._publish_persistent(p)

    def _publish_persistent(self, p: PersistentParams) -> None:
        if not p.master_is_view:
            p.full[p.start:p.end].copy_(p.master)
        self.stream.run(lambda: self.stream.all_gather(p.full, op="persistent_all_gather"))

    def publish_masters(self) -> None:
        for u in self.units:
            if u.shard is not u.master:
                u.shard.copy_(u.master)
        if self.persistent is not None:
            self._publish_persistent(self.persistent)

    def optimizer_slices(self) -> list[OptimizerSlice]:
        out = [OptimizerSlice(bucket=u.bucket, start=start, end=end, master=u.master, moments=u.moments)
               for u in self.units for start, end in [u.bucket.shard_range(self.rank)]]
        p = self.persistent
        if p is not None:
            out.append(OptimizerSlice(bucket=p.bucket, start=p.start, end=p.end, master=p.master, moments=p.moments))
        return out

    def end_step(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()
        if self.persistent is not None:
            self.persistent.grads.zero_()

    def discard(self) -> None:
        """Forget an interrupted micro-batch: wait out queued collectives, free every buffer."""
        self.stream.drain_quietly()
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None
        for u in self.units:
            self._release(u)
            if u.staging is not None:
                u.reduce_pool.release(u.staging)
            u.staging, u.users, u.in_backward, u.reduced = None, 0, False, False
            for p in u.params:
                p.grad = None
        for pool in self.pools:
            for b in pool.buffers:
                b.done = None
        self._live_bytes = 0
        self.end_step()

    def rebind(self, group: Collective) -> None:
        self.group = group
        self.stream.rebind(group)

    # -- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Model-state bytes by category, measured from the tensors held, plus the gathered and
        reduce buffers and the persistent (replicated) parameters, reported apart."""
        counter = StateBytes()
        report, count = counter.report, counter.count

        for u in self.units:
            real = u.bucket.real_in_range(*u.bucket.shard_range(self.rank))
            count("params", u.shard, real)
            count("grads", u.grad_shard, real)
            if u.shard is not u.master:
                count("optimizer_master", u.master, real)
            for t in u.moments.values():
                count("optimizer_moments", t, real)
        p = self.persistent
        report["persistent_params"] = p.full.numel() * p.full.element_size() if p else 0
        report["persistent_grads"] = p.grads.numel() * p.grads.element_size() if p else 0
        if p is not None:
            real = p.bucket.real_in_range(p.start, p.end)
            if not p.master_is_view:
                count("optimizer_master", p.master, real)
            for t in p.moments.values():
                count("optimizer_moments", t, real)
        report["optimizer"] = report["optimizer_master"] + report["optimizer_moments"]
        report["gather_buffers"] = sum(pool.nbytes for pool in self.pools if pool.name.endswith("gather"))
        report["reduce_buffers"] = sum(pool.nbytes for pool in self.pools if pool.name.endswith("reduce"))
        report["gathered_peak"] = self.peak_gathered_bytes
        report["staging_peak"] = report["reduce_buffers"] + sum(pool.overflow_peak for pool in self.pools)
        report["units"] = len(self.units)
        report["persistent_numel"] = p.bucket.numel if p else 0
        report["total"] = (report["params"] + report["grads"] + report["optimizer"] + report["padding"]
                           + report["persistent_params"] + report["persistent_grads"] + report["gather_buffers"]
                           + report["reduce_buffers"])
        report["held_storage_bytes"] = self._held_storage_bytes()
        report["grads_between_steps"] = report["grads"] + report["padding_grads"]  # shards kept, zeroed
        return report

    def _held_storage_bytes(self) -> int:
        """Bytes of the distinct storages behind every tensor this rank holds (views counted once)."""
        tensors: list[torch.Tensor] = []
        for u in self.units:
            tensors += [u.master, u.shard, u.grad_shard, *u.moments.values()]
            tensors += [p.data for p in u.params] + [p.grad for p in u.params if p.grad is not None]
        if self.persistent is not None:
            p = self.persistent
            tensors += [p.full, p.grads, p.master, *p.moments.values()]
        for pool in self.pools:
            tensors += [b.tensor for b in pool.buffers]
        seen: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """This rank's fp32 weights: name -> (start, end, values) over the flattened parameter."""
        out: dict[str, tuple[int, int, torch.Tensor]] = {}
        slices: list[tuple[Bucket, int, int, torch.Tensor]] = [
            (u.bucket, *u.bucket.shard_range(self.rank), u.master) for u in self.units]
        if self.persistent is not None:
            p = self.persistent
            slices.append((p.bucket, p.start, p.end, p.master))
        for bucket, start, end, master in slices:
            for f in self.layout.fragments(bucket.index, start, end):
                name = self.layout.params[f.param].name
                out[name] = (f.param_start, f.param_end, master[f.local_start:f.local_end].float().cpu().clone())
        return out
