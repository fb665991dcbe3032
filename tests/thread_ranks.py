"""Ranks as threads of one process over an in-memory group: the Collective protocol without
Ray, for fast end-to-end checks of an OwnerEngine at world sizes 1-4 (every optimizer, stage and
world size in seconds). The same properties are checked on real Ray actors over gloo in
tests/integration/."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import build_manifest
from zero_ray.collective.collective_api import ByteCounters, chunks
from zero_ray.config import ActivationCheckpointing, Compile, Stage3Config
from zero_ray.control.handlers import StepResult
from zero_ray.core.batching import batch_size, split_batch, split_sizes
from zero_ray.core.offload_options import Offload
from zero_ray.core.optimizer_plan import check_optimizer_factories, declared_kinds
from zero_ray.core.precision import LossScaleConfig, parse_dtype
from zero_ray.core.stages import stage_plan
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.topology import Topology
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.owner.construction.tensor_sharding import join_shards
from zero_ray.owner.resilience.checkpointing import ShardSaver, restore
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.step.run_spec import EngineSpec


class ThreadWorld:
    """Shared slots and a barrier: what the ranks exchange. ``wait_s`` bounds each wait on a peer
    (a peer compiling a frame meanwhile holds it up: minutes on a loaded machine)."""

    def __init__(self, n: int, *, wait_s: float = 60.0) -> None:
        self.n = n
        self.wait_s = wait_s
        self.barrier = threading.Barrier(n, timeout=wait_s)
        self.slots: list[Any] = [None] * n
        # point-to-point messages, by (sender, receiver), in the order they were sent
        self.mail: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (a, b): queue.Queue() for a in range(n) for b in range(n)}


class ThreadGroup:
    """The Collective protocol between threads; counts bytes as a ring would send them."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.n
        self.counters = ByteCounters()

    def _exchange(self, value: Any) -> list[Any]:
        self.world.slots[self.rank] = value
        self.world.barrier.wait()
        values = list(self.world.slots)
        self.world.barrier.wait()
        return values

    def _count(self, op: str, buf: torch.Tensor) -> None:
        self.counters.add(op, (self.world_size - 1) * (buf.numel() // self.world_size) * buf.element_size(),
                          peer=(self.rank + 1) % self.world_size)

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        mine = chunks(buf, self.world_size)[self.rank]
        parts = [chunks(b, self.world_size)[self.rank] for b in self._exchange(buf.clone())]
        total = parts[0].clone()
        for p in parts[1:]:
            total.add_(p)
        mine.copy_(total)
        self._count(op, buf)
        return mine

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        parts = chunks(buf, self.world_size)
        for r, value in enumerate(self._exchange(parts[self.rank].clone())):
            parts[r].copy_(value)
        self._count(op, buf)

    def all_reduce_(self, buf: torch.Tensor) -> None:
        total = sum(self._exchange(buf.clone()))
        buf.copy_(total)
        self._count("all_reduce", buf)  # a reduce-scatter and an all-gather's worth
        self._count("all_reduce", buf)

    def all_reduce_values(self, values: list[float]) -> list[float]:
        rows = self._exchange(list(values))
        self.counters.add("scalars", 8 * len(values))
        return [sum(col) for col in zip(*rows)]

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        for t, peer in sends:
            self.world.mail[(self.rank, peer)].put(t.detach().clone())
            self.counters.add(op, t.numel() * t.element_size(), peer=peer)
        for t, peer in recvs:
            t.copy_(self.world.mail[(peer, self.rank)].get(timeout=self.world.wait_s))

    def barrier(self) -> None:
        self._exchange(None)

    def destroy(self) -> None:
        return None

    def abort(self) -> None:
        return None


def on_threads(world_size: int, fn: Callable[[ThreadGroup], Any], *, timeout_s: float = 120.0,
               wait_s: float = 60.0) -> list[Any]:
    """``fn(group)`` on ``world_size`` thread ranks of one in-memory group; each rank's result.
    The first failure is raised (the others are released from the group's barrier); ranks still
    running after ``timeout_s`` raise TimeoutError, never a half-done result (callers read the
    engines next). ``wait_s`` bounds each wait on a peer."""
    world = ThreadWorld(world_size, wait_s=wait_s)
    out: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            out[rank] = fn(ThreadGroup(world, rank))
        except BaseException as err:  # reported by the test thread
            errors.append(err)
            world.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    running = [r for r, t in enumerate(threads) if t.is_alive()]
    if running:
        world.barrier.abort()  # release them from the group: they end with BrokenBarrierError
        raise TimeoutError(f"thread ranks {running} of {world_size} still running after {timeout_s:g}s; "
                           f"pass a larger timeout_s where the ranks compile or the machine is loaded")
    return out


_BUILD_LOCK = threading.Lock()  # low_memory construction patches process-wide torch hooks


def engine_spec(model_fn: Callable[[], torch.nn.Module], loss_fn: Any, optimizer: Any, *, accum: int = 1,
                clip: float | None = None, dtype: str = "float32", stage: int = 3,
                checkpointing: ActivationCheckpointing | None = None, lr_scheduler: Any = None,
                reduce_dtype: str | None = None, optimizer_kinds: Any = None, bucket_bytes: int = 2048,
                on_nonfinite: str = "raise", topology: Topology | None = None, compile: Compile | None = None,
                offload: Offload | None = None, tensor_parallel: TensorParallel | None = None,
                **stage3: Any) -> EngineSpec:
    """The spec thread ranks build from (2 KiB buckets; at stage 3 every module a unit by default)."""
    stage3.setdefault("wrap_policy", WrapPolicy(min_numel=0))
    return EngineSpec(model_fn=model_fn, loss_fn=loss_fn, optimizers=check_optimizer_factories(optimizer),
                      plan=stage_plan(stage), compute_dtype=parse_dtype(dtype), device="cpu", seed=0,
                      bucket_bytes=bucket_bytes, grad_accum_steps=accum, max_grad_norm=clip,
                      loss_scale=LossScaleConfig(), stage3=Stage3Config(**stage3) if stage == 3 else Stage3Config(),
                      activation_checkpointing=checkpointing, lr_scheduler=lr_scheduler,
                      reduce_dtype=parse_dtype(reduce_dtype) if reduce_dtype else None,
                      optimizer_kinds=declared_kinds(optimizer_kinds), on_nonfinite=on_nonfinite,
                      topology=topology or Topology(), compile=compile, offload=offload or Offload(),
                      tensor_parallel=tensor_parallel or TensorParallel())


def run_ranks(world_size: int, model_fn: Callable[[], torch.nn.Module], loss_fn: Any, optimizer: Any,
              batches: list[Any], *, accum: int = 1, clip: float | None = None, dtype: str = "float32",
              stage: int = 3, checkpointing: ActivationCheckpointing | None = None, lr_scheduler: Any = None,
              reduce_dtype: str | None = None, optimizer_kinds: Any = None, bucket_bytes: int = 2048,
              on_nonfinite: str = "raise", results: list[list[StepResult]] | None = None,
              topology: Topology | None = None, nodes: list[str] | None = None, compile: Compile | None = None,
              offload: Offload | None = None, timeout_s: float = 120.0,
              **stage3: Any) -> tuple[dict[str, torch.Tensor], list[OwnerEngine], list[list[dict[str, int]]]]:
    """Train on ``world_size`` thread ranks; the consolidated fp32 parameters, the engines and
    each step's bytes sent per rank. ``results``: filled with each rank's StepResults;
    ``nodes``: the node each rank is on, for ``topology``; ``timeout_s``: the whole run's bound
    (each wait on a peer gets half)."""
    spec = engine_spec(model_fn, loss_fn, optimizer, accum=accum, clip=clip, dtype=dtype, stage=stage,
                       checkpointing=checkpointing, lr_scheduler=lr_scheduler, reduce_dtype=reduce_dtype,
                       optimizer_kinds=optimizer_kinds, bucket_bytes=bucket_bytes, on_nonfinite=on_nonfinite,
                       topology=topology, compile=compile, offload=offload, **stage3)
    if results is not None:
        results[:] = [[] for _ in range(world_size)]
    engines: list[OwnerEngine | None] = [None] * world_size
    sent: list[list[dict[str, int]]] = [[] for _ in range(world_size)]

    def rank_main(group: ThreadGroup) -> None:
        rank = group.rank
        # Stages 0-2 seed the process-wide RNG and build the whole module: one rank at a time.
        if stage < 3 or spec.stage3.init == "low_memory" or spec.init_state_dict is not None:
            with _BUILD_LOCK:
                engine = OwnerEngine(spec, rank=rank, group=group, nodes=nodes)
        else:
            engine = OwnerEngine(spec, rank=rank, group=group, nodes=nodes)
        engines[rank] = engine
        # No rank steps while another builds: a step can set the process-wide RNG (activation
        # checkpointing's recomputation restores the forward's), which a build is drawing from.
        group.barrier()
        for batch in batches:
            n = batch_size(batch)
            piece = split_batch(batch, split_sizes(n, world_size))[rank]
            result = engine.step(piece, global_samples=n)
            if results is not None:
                results[rank].append(result)
            sent[rank].append(dict(engine.last_bytes))

    on_threads(world_size, rank_main, timeout_s=timeout_s, wait_s=timeout_s / 2)
    full: dict[str, torch.Tensor] = {}
    ready = [e for e in engines if e is not None]
    for engine in ready:
        for name, (lo, hi, values) in engine.master_fragments().items():
            shape = engine.layout.param(name).shape
            full.setdefault(name, torch.empty(shape).reshape(-1))[lo:hi] = values
    shapes = {p.name: p.shape for p in ready[0].layout.params}
    return {n: v.view(shapes[n]) for n, v in full.items()}, ready, sent




def run_tp_ranks(size: int, data_parallel: int, model_fn: Callable[[], torch.nn.Module], loss_fn: Any, optimizer: Any,
                 batches: list[Any], *, plan: Any = None, stage: int = 3, clip: float | None = None,
                 accum: int = 1, load: str | None = None, save: str | None = None, sequence_parallel: bool = False,
                 timeout_s: float = 120.0,
                 **options: Any) -> tuple[dict[str, torch.Tensor], list[float], list[OwnerEngine], list[list[StepResult]]]:
    """Train on ``size`` x ``data_parallel`` thread ranks with tensor parallelism of ``size``:
    each engine reads its data rank's piece of every batch. Returns the fp32 parameters
    consolidated to their whole shapes (each TP shard's masters from its data-parallel ranks,
    then the shards joined), the per-step global mean losses, the engines and each rank's
    StepResults. ``load``: every rank first restores the checkpoint there (the owners' Load);
    ``save``: after the steps every rank saves under that root and the checkpoint is committed
    as the driver's commit thread does (the owners' Save, then the manifest). ``timeout_s``: the
    whole run's bound (each wait on a peer gets half)."""
    world = size * data_parallel
    spec = engine_spec(model_fn, loss_fn, optimizer, stage=stage, clip=clip, accum=accum,
                       tensor_parallel=TensorParallel(size=size, plan=plan, sequence_parallel=sequence_parallel),
                       **options)
    engines: list[OwnerEngine | None] = [None] * world
    results: list[list[StepResult]] = [[] for _ in range(world)]
    pending = store.begin(save, len(batches)) if save is not None else None
    saved: list[tuple[Any, dict[str, Any]] | None] = [None] * world

    def rank_main(group: ThreadGroup) -> None:
        # Stages 0-2 build the whole module from the process-wide RNG: one rank at a time (stage 3
        # takes turns itself, and its turns wait on the other ranks)
        if stage < 3:
            with _BUILD_LOCK:
                engine = OwnerEngine(spec, rank=group.rank, group=group)
        else:
            engine = OwnerEngine(spec, rank=group.rank, group=group)
        engines[group.rank] = engine
        group.barrier()
        if load is not None:
            restore(engine, load)
        for batch in batches:
            n = batch_size(batch)
            piece = split_batch(batch, split_sizes(n, engine.data_world_size))[engine.data_rank]
            results[group.rank].append(engine.step(piece, global_samples=n))
        if pending is not None:
            saver = ShardSaver()
            saver.start(engine, pending.tmp)
            saved[group.rank] = saver.wait(pending.tmp, timeout_s=60)
            saver.close()

    on_threads(world, rank_main, timeout_s=timeout_s, wait_s=timeout_s / 2)
    ready = [e for e in engines if e is not None]
    if pending is not None:
        e = ready[0]
        manifest = build_manifest(models=[model for _, model in saved], files=[f for f, _ in saved],
                                  step=e.position.step, samples_seen=e.position.samples_seen, world_size=world,
                                  stage=stage, compute_dtype="float32", seed=0)
        store.commit(pending, manifest, keep=8)
    per_tp: list[dict[str, torch.Tensor]] = []
    for t in range(size):
        local: dict[str, torch.Tensor] = {}
        for engine in ready[t::size]:  # the data-parallel ranks holding TP shard t
            for name, (lo, hi, values) in engine.master_fragments().items():
                local.setdefault(name, torch.empty(engine.layout.param(name).shape).reshape(-1))[lo:hi] = values
        per_tp.append({n: v.view(ready[t].layout.param(n).shape) for n, v in local.items()})
    full = join_shards(ready[0].module, per_tp)
    losses = [sum(results[r][k].totals.loss_sum for r in range(0, world, size)) / batch_size(batches[k])
              for k in range(len(batches))]
    return full, losses, ready, results
