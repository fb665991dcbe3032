"""ModelState: one rank's model, built as parameter groups, for every stage.

Building: the module comes from ``model_fn()`` (whole on the host, one rank of a node at a time
when parameters are partitioned; or with meta parameters, from recorded initialisations or a
state dict), ``core.groups.plan_groups`` splits its parameters into groups (size buckets, or per
stage-3 unit; trainable and frozen apart), ``FlatLayout`` lays the groups out as buckets, and
each ``ParamGroup`` takes its values from the source and binds the module's parameters to its
storage. The user's optimizer factories are called on the module first (``core/optimizer_plan
.plan_optimizers``): which optimizer steps each parameter splits the groups, and a
``ShardOptimizer`` runs the user's classes over what this rank updates. A ``GradReducer``
combines the trainable groups' gradients; where groups are gathered per use a
``UnitScheduler`` gathers and frees them around each unit.

What differs between stages is in the groups' policies; this class only wires the pieces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from zero_ray.collective.device_sync import DeviceSync, device_sync
from zero_ray.collective.collective_api import Collective
from zero_ray.collective.stream import CommStream
from zero_ray.config import Compile
from zero_ray.core.group_policy import GradFlow, GroupSpec, ParamResidency, plan_groups
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.optimizer_plan import OptimizersPlan, UpdateKind, plan_optimizers, qualified_name
from zero_ray.core.stages import Residency
from zero_ray.core.tensor_parallel_plan import COLWISE, TensorParallelPlan
from zero_ray.core.stage3_units import (
    ModuleInfo,
    UnitPlan,
    WrapPolicy,
    innermost_units,
    outermost_units,
    plan_units,
    repeated_blocks,
)
from zero_ray.errors import ConfigError
from zero_ray.owner.tensors.accounting import StateCounter, held_storage_bytes
from zero_ray.owner.construction.activations import SavedInputs, apply_activation_checkpointing
from zero_ray.owner.tensors.buffers import BufferPool
from zero_ray.owner.construction.compiled import apply_compile
from zero_ray.owner.construction.tensor_sharding import shard_model
from zero_ray.owner.step.rank_collectives import Fabric
from zero_ray.owner.construction.materialize import build_recorded
from zero_ray.owner.tensors.state_files import StateFiles
from zero_ray.owner.step.optimizer import ShardOptimizer
from zero_ray.owner.step.param_group import OptimizerSlice, ParamGroup
from zero_ray.owner.step.reducer import GradReducer
from zero_ray.owner.step.unit_scheduler import Unit, UnitScheduler
from zero_ray.owner.construction.sources import (
    ModuleSource,
    ParamSource,
    RecipeSource,
    StateDictSource,
    build_module,
    cast_buffers,
    check_module,
    describe_modules,
    node_turn,
    param_specs,
)
from zero_ray.owner.step.run_spec import EngineSpec

#: staging buffers for gradients reduced per micro-batch from whole parameters (stage 2), each
#: as large as the largest group: one being filled by backward while the other is reduced (per
#: optimizer: each optimizer's groups fill in backward order of their own)
STAGING_BUFFERS = 2


class ModelState:
    """A rank's module, its parameter groups and what moves their gradients and parameters."""

    def __init__(self, spec: EngineSpec, *, rank: int, group: Collective, device: torch.device,
                 fabric: Fabric | None = None) -> None:
        self.spec = spec
        self.rank = rank
        # What the groups are sharded over: the world group, or (a Topology) the rank's shard group.
        self.fabric = fabric if fabric is not None else Fabric(spec.topology, group,
                                                               tensor_parallel=spec.tensor_parallel)
        self.shard_rank = self.fabric.primary.rank
        self.dtype = spec.compute_dtype
        self.reduce_dtype = spec.reduce_dtype or spec.compute_dtype  # of gradient buffers and reductions
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self.device = self._empty.device  # with its index ("cuda:0"), as tensors report it
        self.sync: DeviceSync = device_sync(self.device)
        self._collective = group
        self.layout: FlatLayout
        self.module: nn.Module
        self.groups: list[ParamGroup] = []
        self.trainable_groups: list[ParamGroup] = []  # of groups: those with gradients
        self.units: list[Unit] = []
        self.pools: list[BufferPool] = []
        self.trainable: list[bool] = []  # by layout parameter index
        self.optim_plan: OptimizersPlan
        self.optimizer: ShardOptimizer
        self.scheduler: UnitScheduler | None = None
        self.stream: CommStream  # the rank's comm thread: every collective of a step, in order
        self.reducer: GradReducer
        self.checkpointed: list[str] = []  # paths of the units whose activations are recomputed
        self.saved_inputs = SavedInputs()  # P_a (T > 1): the checkpointed inputs this rank keeps and gathers
        self.compiled: list[str] = []  # paths of the units whose forward is torch.compile'd
        self.state_files: StateFiles | None = None  # Offload(...="nvme"): where offloaded state lives
        self.tp_plan: TensorParallelPlan | None = None  # T > 1: how the module was split over the TP group
        # T > 1: per trainable group, the [lo, hi) ranges of its update slice holding replicated
        # parameters (every TP rank holds them: the global norm counts them once)
        self._replicated: list[list[tuple[int, int]]] = []
        self._in_step: dict[str, int] | None = None
        self._counted_state = -1  # the optimizer's state version _in_step was counted at
        self._construct()

    # -- construction ---------------------------------------------------------------------------------
    def _construct(self) -> None:
        spec = self.spec
        per_use = spec.plan.parameters is Residency.SHARDED
        if self.fabric.tensor is not None and (spec.init_state_dict is not None or
                                               (per_use and spec.stage3.init == "low_memory")):
            raise ConfigError(f"tensor_parallel size={spec.tensor_parallel.size} builds the whole module on each "
                              "rank and shards it; starting from init_state_dict or Stage3Config(init='low_memory') "
                              "is not built with tensor parallelism yet (docs/tensor_parallel.md)")
        if spec.init_state_dict is not None:
            # Partitioned parameters never exist whole: build the structure on meta, read values by slice.
            module = (check_module(build_recorded(spec.model_fn, seed=spec.seed, record=False)[0]) if per_use
                      else build_module(spec.model_fn, spec.seed))
            _, _, names = describe_modules(module)
            shapes = [tuple(p.shape) for p in module.parameters()]
            self._bind(module, StateDictSource(spec.init_state_dict, names=names, shapes=shapes))
        elif per_use and spec.stage3.init == "low_memory":
            module, recorder = build_recorded(spec.model_fn, seed=spec.seed)
            module = check_module(module)
            self._bind(module, RecipeSource(recorder, list(module.parameters())))
        elif per_use:
            # Whole on the host, one rank of a node at a time: a host never holds two full copies.
            turn, turns = node_turn(self._collective, self.rank)
            for t in range(turns):
                if t == turn:
                    module = self._whole_module()
                    self._bind(module, ModuleSource(list(module.parameters())))
                    del module
                self._collective.barrier()
        else:
            module = self._whole_module()
            self._bind(module, ModuleSource(list(module.parameters())))

    def _whole_module(self) -> nn.Module:
        """The seeded module, split over the rank's TP group by its plan where T > 1 (every
        rank builds the same whole module, then keeps its slices)."""
        module = build_module(self.spec.model_fn, self.spec.seed)
        if self.fabric.tensor is not None:
            self.tp_plan = shard_model(module, self.spec.tensor_parallel, self.fabric.tensor)
        return module

    def _bind(self, module: nn.Module, source: ParamSource) -> None:
        spec, n = self.spec, self.fabric.primary.world_size
        infos, sites, names = describe_modules(module)
        named = list(module.named_parameters())
        self.trainable = [p.requires_grad for _, p in named]
        # Before any parameter is bound: the factories see real shapes (meta where not materialised).
        self.optim_plan = plan = plan_optimizers(spec.optimizers, module, declared=spec.optimizer_kinds)
        if self.tp_plan is not None:
            self._refuse_whole_tensor_shards(plan, [name for name, _ in named], self.tp_plan)
        units: UnitPlan | None = None
        if spec.plan.parameters is Residency.SHARDED:
            units = plan_units(infos, [p.numel() for _, p in named], policy=spec.stage3.wrap_policy,
                               persistence_threshold=spec.stage3.persistence_threshold, sites=sites)
        element = torch.finfo(self.dtype).bits // 8
        specs = plan_groups(spec.plan, shapes=[tuple(p.shape) for _, p in named], trainable=self.trainable,
                            bucket_numel=max(1, spec.bucket_bytes // element), units=units,
                            optimizer_of=plan.of_param)
        self.layout = layout = FlatLayout.build(param_specs(module), world_size=n,
                                                groups=[list(g.params) for g in specs])
        params = self._placeholders(module, [p for _, p in named], names)
        gather_of, staging_of = self._pools(specs, units, layout)
        self.state_files = files = self._state_files(plan)
        offload = spec.offload
        self.groups = [ParamGroup(g, layout=layout, params=[params[i] for i in g.params], rank=self.shard_rank,
                                  dtype=self.dtype, device=self.device, source=source, empty=self._empty,
                                  staging=staging_of.get(g.index), reduce_dtype=self.reduce_dtype,
                                  state_files=files if offload.optimizer_on_nvme else None,
                                  param_files=files if offload.params_on_nvme else None) for g in specs]
        # The groups a step reduces and updates, fixed with the groups (read many times a step).
        self.trainable_groups = [g for g in self.groups if g.trainable]
        self.fabric.allocate(self.groups)
        self.optimizer = ShardOptimizer(plan, self.groups, layout=layout, rank=self.shard_rank,
                                        update_whole=spec.plan.updates_whole_buffer, scheduler=spec.lr_scheduler,
                                        device=self.device, streamed=files is not None)
        for name, buf in module.named_buffers():
            value = source.buffer(name)
            if value is not None:
                with torch.no_grad():
                    buf.copy_(value)
        module.to(self.device)
        cast_buffers(module, self.dtype)
        self.module = module
        staging = [p for p in self.pools if p.name.endswith(("staging", "reduce"))]
        self.stream = CommStream(self.fabric.primary, sync=self.sync, name=f"zero_ray-grads-{self.rank}")
        self.reducer = GradReducer(self.trainable_groups, self.stream, micro_batches=spec.grad_accum_steps,
                                   staging=staging)
        if units is not None:
            self.units = [Unit(spec=u, module=module.get_submodule(u.path), pool=gather_of[u.index],
                               groups=sorted((g for g in self.groups if g.spec.unit == u.index),
                                             key=lambda g: not g.policy.trainable))
                          for u in units.units]
            self.scheduler = UnitScheduler(self.units, root=module, config=spec.stage3, stream=self.stream,
                                           reducer=self.reducer, device=self.device, fabric=self.fabric,
                                           pools=[p for p in self.pools if p.name.endswith(("gather", "reduce"))])
        numels = [p.numel() for _, p in named]
        if spec.compile is not None:  # compiled first: checkpointing then recomputes the compiled forward
            self.compiled = apply_compile(module, self._compiled_paths(spec.compile, infos, sites, numels, units),
                                          spec.compile)
            if self.scheduler is not None:
                self.scheduler.compiled(self.compiled)
        ac = spec.activation_checkpointing
        if ac is not None:
            tp = self.fabric.tensor
            # P_a: on by default; with sequence parallelism a block's input is 1/T already, not replicated
            sp = spec.tensor_parallel is not None and spec.tensor_parallel.sequence_parallel
            partition = tp if tp is not None and ac.partition is not False and not sp else None
            self.checkpointed = apply_activation_checkpointing(
                module, self._unit_paths(ac.wrap_policy, infos, sites, numels, units, what="activation_checkpointing"),
                offload=ac.offload, partition=partition, ledger=self.saved_inputs,
                reentry=self.scheduler.recompute if self.scheduler is not None else None)
        for g in self.groups:
            g.acquire_grads()  # counted by memory_report() before the first step
        if self.tp_plan is not None:
            self._replicated = self._replicated_ranges(self.tp_plan)

    @staticmethod
    def _sharded_names(plan: TensorParallelPlan) -> set[str]:
        """Parameters split over the TP group (a rowwise layer's bias stays whole)."""
        return {f"{s.name}.weight" for s in plan.shards} | {f"{s.name}.bias" for s in plan.shards
                                                           if s.style == COLWISE}

    def _refuse_whole_tensor_shards(self, optim: OptimizersPlan, names: list[str], plan: TensorParallelPlan) -> None:
        """A whole-tensor optimizer (Muon's Newton-Schulz, Adafactor's factored moments) over a TP
        shard would step a slice as if it were the matrix: refused, naming it."""
        sharded = self._sharded_names(plan)
        bad = [(name, qualified_name(optim.optimizers[o].cls)) for i, name in enumerate(names)
               if name in sharded and (o := optim.of_param[i]) is not None
               and optim.optimizers[o].kind is UpdateKind.WHOLE_TENSOR]
        if bad:
            raise ConfigError(f"{bad[0][1]} steps whole tensors, but tensor_parallel size={plan.size} splits "
                              f"{len(bad)} of its parameters over the TP group (e.g. {bad[0][0]!r}); stepping a "
                              "TP-sharded matrix whole is not built yet: give those parameters an element-wise "
                              "optimizer (torch.optim.AdamW) or mark their modules 'replicated' in the plan")

    def _replicated_ranges(self, plan: TensorParallelPlan) -> list[list[tuple[int, int]]]:
        sharded = self._sharded_names(plan)
        return [[(lo, hi) for i, lo, hi in g.pieces if self.layout.params[i].name not in sharded]
                for g in self.trainable_groups]

    def _compiled_paths(self, options: Compile, infos: list[ModuleInfo], sites: list[list[str]], numels: list[int],
                        units: UnitPlan | None) -> list[str]:
        """Stage 3: the innermost units, whose gather and free hooks stay outside the compiled
        region; otherwise the outermost modules of the compile's own policy, by default the
        model's repeated blocks."""
        if units is None:
            policy = options.wrap_policy
            if policy is None:
                blocks = repeated_blocks(infos)
                if not blocks:
                    raise ConfigError("compile found no repeated block to compile (no module class held twice in a "
                                      "ModuleList or Sequential): name the blocks with zr.Compile(wrap_policy=(MyBlock,))")
                policy = WrapPolicy(classes=blocks)
            return self._unit_paths(policy, infos, sites, numels, None, what="compile")
        paths = innermost_units(units)
        if not paths:
            raise ConfigError("compile found no stage-3 unit to compile besides the root: name the blocks with "
                              "Stage3Config(wrap_policy=(MyBlock,))")
        return paths

    def _unit_paths(self, policy: WrapPolicy | None, infos: list[ModuleInfo], sites: list[list[str]],
                    numels: list[int], units: UnitPlan | None, *, what: str) -> list[str]:
        """The outermost non-root units ``policy`` chooses (the stage-3 units themselves unless
        ``what`` names a policy of its own), for activation checkpointing or compilation."""
        if units is None or policy is not None:
            units = plan_units(infos, numels, policy=policy or self.spec.stage3.wrap_policy, sites=sites)
        paths = outermost_units(units)
        if not paths:
            option = {"compile": "zr.Compile", "activation_checkpointing": "ActivationCheckpointing"}[what]
            raise ConfigError(f"{what} found no module to apply to: the wrap policy chose no unit besides the root "
                              "(by default, direct children with at least 2**16 elements). Name the blocks: "
                              f"{option}(wrap_policy=(MyBlock,))")
        return paths

    def _placeholders(self, module: nn.Module, params: list[nn.Parameter], names: list[list[str]]) -> list[nn.Parameter]:
        """The module's parameters, with those built on the meta device replaced (under every name
        that registers them) by parameters the groups can bind to storage."""
        out = []
        for p, aliases in zip(params, names):
            if p.is_meta:
                new = nn.Parameter(self._empty, requires_grad=p.requires_grad)
                for full_name in aliases:
                    owner, _, attr = full_name.rpartition(".")
                    module.get_submodule(owner).register_parameter(attr, new)
                p = new
            out.append(p)
        return out

    def _state_files(self, plan: OptimizersPlan) -> StateFiles | None:
        """Where offloaded state lives: files on local disk (``Offload(optimizer="nvme")`` and/or
        ``Offload(params="nvme")``), else None (memory). Refused where it is not built:
        whole-tensor optimizers (their state is not in the groups' flat buffers, and the update
        streams one group at a time) and GPU owners (it would need host staging)."""
        offload = self.spec.offload
        if not offload.any_on_nvme:
            return None
        whole = sorted(qualified_name(o.cls) for o in plan.optimizers if o.kind is UpdateKind.WHOLE_TENSOR)
        if whole:
            raise ConfigError(f"{offload} streams the update one group at a time over element-wise optimizer state, "
                              f"but {', '.join(whole)} steps whole tensors; keep the state in memory (Offload()) or "
                              "use an element-wise optimizer such as torch.optim.AdamW")
        if self.device.type != "cpu":
            raise ConfigError(f"{offload} is built for CPU owners; this owner's device is {self.device}. Use "
                              "device='cpu' or Offload()")
        assert offload.path is not None  # Offload's own check
        return StateFiles(offload.path, rank=self.rank)

    def _pools(self, specs: list[GroupSpec], units: UnitPlan | None,
               layout: FlatLayout) -> tuple[dict[int, BufferPool], dict[int, BufferPool]]:
        """The buffer pools: gradient staging for whole parameters reduced per micro-batch; for
        units, gathered and reduce buffers shared by the non-root units and the root's own
        (the root is live for the whole forward and backward). Returns pools by unit (gather)
        and by group (staging)."""
        def padded(g: GroupSpec) -> int:
            return layout.buckets[g.index].padded_numel

        staging_of: dict[int, BufferPool] = {}
        whole = [g for g in specs if g.policy.params is ParamResidency.WHOLE
                 and g.policy.grads is GradFlow.PER_MICRO_BATCH]
        if whole:
            # On a GPU up front, one contiguous block (M_D: the allocator cannot fragment it);
            # on a CPU on first need, so that a model too small to need both holds one.
            # Each optimizer's groups fill in backward order, but two optimizers' groups fill at
            # once (Muon's matrices and AdamW's vectors of one block): two buffers per optimizer.
            streams = len({g.optimizer for g in whole})
            pool = BufferPool(name="staging", count=STAGING_BUFFERS * streams, numel=max(padded(g) for g in whole),
                              dtype=self.reduce_dtype, device=self.device, preallocate=self.device.type == "cuda")
            self.pools.append(pool)
            staging_of.update({g.index: pool for g in whole})
        gather_of: dict[int, BufferPool] = {}
        if units is None:
            return gather_of, staging_of
        cfg = self.spec.stage3
        root = next((u for u in units.units if u.path == ""), None)
        nonroot = [u for u in units.units if u.path != ""]
        nesting = 1 + max((u.depth - (1 if root is not None else 0) for u in nonroot), default=-1)
        count = cfg.max_live_units if cfg.max_live_units is not None else nesting + cfg.prefetch_depth + 1
        if nonroot and count < nesting:
            raise ConfigError(f"max_live_units={count} is below the unit nesting depth {nesting}: nested units "
                              "are gathered together; raise max_live_units")

        def members(unit: int) -> list[GroupSpec]:
            return [g for g in specs if g.unit == unit]

        for name, chosen, n in (("", nonroot, count if nonroot else 0), ("root_", [root] if root else [], 1)):
            if not chosen:
                continue
            gather = BufferPool(name=name + "gather", count=n, numel=max(sum(padded(g) for g in members(u.index))
                                                                          for u in chosen),
                                dtype=self.dtype, device=self.device, preallocate=True)
            trained = [g for u in chosen for g in members(u.index) if g.policy.trainable]
            reduce = BufferPool(name=name + "reduce", count=n if trained else 0,
                                numel=max((padded(g) for g in trained), default=0), dtype=self.reduce_dtype,
                                device=self.device, preallocate=True)
            self.pools += [gather, reduce]
            gather_of.update({u.index: gather for u in chosen})
            staging_of.update({g.index: reduce for g in trained})
        return gather_of, staging_of

    # -- the step ---------------------------------------------------------------------------------------
    def all_reduce_values(self, values: list[float]) -> list[float]:
        """Sum a few of the step's control scalars across ranks, on the comm stream after the
        collectives already issued (waited for)."""
        if self.fabric.tensor is not None:
            # over the world, even where the data-parallel group the stream serves is one rank
            primary = self.fabric.primary
            return self.stream.run(lambda: primary.all_reduce_values(values))
        return self.stream.all_reduce_values(values)

    def begin_micro_batch(self) -> None:
        self.reducer.begin_micro_batch()
        if self.scheduler is not None:
            self.scheduler.begin_micro_batch()

    def end_micro_batch(self, *, last: bool) -> None:
        if self.scheduler is not None:
            self.scheduler.end_micro_batch()
        self.reducer.end_micro_batch(last=last)

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        """Around a forward that is not part of a step (evaluation)."""
        if self.scheduler is None:
            yield
            return
        with self.scheduler.forward_only():
            yield

    def tp_squares(self, grads: list[torch.Tensor]) -> tuple[float, float]:
        """The squared norm of ``grads`` (``update_grads``' order) as (TP-sharded parameters'
        part, replicated parameters' part)."""
        total = replicated = 0.0
        for g, ranges in zip(grads, self._replicated, strict=True):
            total += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
            for lo, hi in ranges:
                replicated += float(torch.linalg.vector_norm(g[lo:hi], dtype=torch.float32)) ** 2
        return total - replicated, replicated

    def update_grads(self) -> list[torch.Tensor]:
        """One reduced gradient per trainable group (reduce dtype, over its update slice)."""
        return [g.update_grad() for g in self.trainable_groups]

    def used_marks(self) -> list[bool]:
        """Per trainable parameter (layout order): whether this rank saw a gradient this step."""
        seen = [False] * len(self.trainable)
        for g in self.trainable_groups:
            for i, used in zip(g.members, g.used):
                seen[i] = used
        return [seen[i] for i, t in enumerate(self.trainable) if t]

    def expand_marks(self, marks: list[bool]) -> list[bool]:
        """``used_marks``-ordered marks as a list by layout parameter index (frozen: False)."""
        out, it = [False] * len(self.trainable), iter(marks)
        for i, t in enumerate(self.trainable):
            if t:
                out[i] = next(it)
        return out

    def apply_update(self, grads: list[torch.Tensor], *, used: list[bool]) -> None:
        """Step the user's optimizers over the parameters some rank produced a gradient for
        (``used``, by layout index; torch skips the others) and publish them."""
        stream = self.stream
        self.optimizer.step({g.index: grad for g, grad in zip(self.trainable_groups, grads)}, used, stream)
        # The step's peak of model state: every gradient reduced, none released yet, the
        # optimizer's state created. Sizes change only when torch creates state, so the count is
        # taken again only then.
        if self._counted_state != self.optimizer.version:
            self._in_step, self._counted_state = self._count(), self.optimizer.version
        if self.fabric.secondary is not None:  # hpZ's copies hold the old parameters (none without hpZ)
            self.fabric.forget()
        for g in self.trainable_groups:
            g.publish(stream)

    def publish_masters(self) -> None:
        """Make the compute-dtype parameters agree with the masters after they were overwritten
        (a checkpoint restore, a reshard): copy, and all-gather where parameters are whole."""
        self.fabric.forget()
        for g in self.groups:
            g.publish(self.stream)

    def end_step(self) -> None:
        """The update has used the step's gradients: release them."""
        for g in self.trainable_groups:
            g.release_grads()

    def discard(self) -> None:
        """Forget an interrupted step."""
        if self.scheduler is not None:
            self.scheduler.discard()
        self.reducer.reset()
        self.fabric.forget()

    def rebind(self, group: Collective) -> None:
        self._collective = group
        self.fabric = self.fabric.rebind(group)
        self.fabric.allocate(self.groups)
        self.stream.rebind(self.fabric.primary)
        if self.scheduler is not None:
            self.scheduler.fabric = self.fabric

    # -- reports and transfer -------------------------------------------------------------------------
    def _count(self) -> dict[str, int]:
        counter = StateCounter()
        for g in self.groups:
            g.count(counter)
        self.optimizer.count(counter)
        self.fabric.count(counter)
        report = counter.finish()
        for key in ("persistent_params", "persistent_grads", "params_secondary"):
            report.setdefault(key, 0)
        gathered = sum(p.nbytes for p in self.pools if p.name.endswith("gather"))
        reduce = sum(p.nbytes for p in self.pools if p.name.endswith("reduce"))
        report["gather_buffers"], report["reduce_buffers"] = gathered, reduce
        report["total"] += (report["persistent_params"] + report["persistent_grads"] + report["params_secondary"]
                            + gathered + reduce)
        report["resident"] = report["total"] - report["nvme"]  # the rest of the model state is in memory
        tensors = [t for g in self.groups for t in g.tensors()] + self.optimizer.tensors() + self.fabric.tensors()
        tensors += [b.tensor for p in self.pools if p.name.endswith(("gather", "reduce")) for b in p.buffers]
        report["held_storage_bytes"] = held_storage_bytes(tensors)
        return report

    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of units' parameters gathered at once (0 when nothing is gathered)."""
        return self.scheduler.peak_gathered_bytes if self.scheduler is not None else 0

    def memory_report(self) -> dict[str, int]:
        """Model state during a step, the paper's figure: counted at the last step's peak (every
        gradient reduced, none released) or, before any step, as allocated. Between steps the
        gradients are released (``grads_between_steps``)."""
        report = dict(self._in_step or self._count())
        report["grads_between_steps"] = 0  # released after every update
        report["staging_peak"] = self.reducer.peak_staging_bytes()
        report["gathered_peak"] = self.peak_gathered_bytes
        report["units"] = len(self.units)
        report["persistent_numel"] = sum(g.bucket.numel for g in self.groups if g.policy.label)
        report["trainable_numel"] = sum(g.bucket.numel for g in self.trainable_groups)
        return report

    def evict_state(self) -> None:
        """Offloaded state (optimizer state, stage-3 parameter shards): out of memory again after
        something read or wrote it all (a snapshot, a restore); it stays in its files. Nothing
        to do when it is in memory."""
        for g in self.groups:
            g.evict_state()

    def optimizer_slices(self) -> list[OptimizerSlice]:
        """Every group's slice, in layout-bucket order (frozen ones without moments)."""
        return [g.optimizer_slice() for g in self.groups]

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        out: dict[str, tuple[int, int, torch.Tensor]] = {}
        for g in self.groups:
            out.update(g.master_fragments(self.layout))
        return out
