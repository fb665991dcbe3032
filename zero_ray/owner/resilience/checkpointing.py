"""One rank's side of a checkpoint: snapshot its slices, write them in the background, and
restore the ranges a (possibly different) layout needs.

Saving copies every slice this rank owns to host memory (the only part that stalls training)
and writes the rank file on a background thread; the driver commits the checkpoint once every
rank's file is durable. With a replicated optimizer (stage 0) every rank holds everything, so
each saves only its own shard range: no element is written twice. With shard groups
(``Topology(shard_group_size=G)``) the state is laid out over G owners and every group holds a
copy: the first group writes it, as ranks 0..G-1 of a flat run of G (``Mesh.save_role``), and
the other groups write nothing, so any layout reads it back as it reads a flat checkpoint.
With tensor parallelism (T > 1) every TP rank writes its slices of the sharded parameters, each
entry carrying the slice's offsets and extent in the whole tensor, and TP rank 0 alone writes the
replicated parameters (and their whole-tensor state, and the buffers), so a checkpoint holds each
element once and any (T', D') reads it back (checkpoint/format.py).

Restoring reads, for every range this rank updates in the new layout, the saved pieces that
cover it; everything is read and verified before any live tensor changes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, replace
from typing import Any

import torch

from zero_ray.checkpoint.format import (
    BUFFER,
    DEFAULT_CHUNK_BYTES,
    MASTER,
    RNG,
    Manifest,
    ShardFile,
    model_mismatch,
    shard_file_name,
    state_kind,
    whole_kind,
)
from zero_ray.checkpoint.shardfile import Item, write_shard
from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.core.optim_state import table_by_name, table_from_names
from zero_ray.core.run_position import Position
from zero_ray.errors import CheckpointError
from zero_ray.owner.construction.tensor_sharding import shard_blocks
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.tensors.host_copy import host_copies
from zero_ray.owner.step.rollback import persistent_buffers, rng_states, set_rng_states


def _param_aliases(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def snapshot(engine: OwnerEngine) -> list[Item]:
    """This rank's saved tensors as host copies: master weights and element-wise optimizer state
    of every element it owns, the whole-tensor state of the parameters it is the assignee of,
    its RNG states (``rng/torch/<rank>``, and ``rng/cuda/<rank>`` on a GPU; by world rank), and
    (rank 0) the module's buffers. Shard ranges are those of the rank in its shard group (the
    world rank when flat); a rank of a group that does not write (``Mesh.save_role``) saves nothing."""
    if not engine.fabric.save_role.writes:
        return []
    rank, layout = engine.state.shard_rank, engine.layout
    optimizer = engine.state.optimizer
    table = optimizer.table()
    blocks = shard_blocks(engine.module)
    first_tp = engine.fabric.ranks.tp_rank(engine.rank) == 0  # writes what every TP rank holds alike
    items: list[Item] = []
    sources: list[torch.Tensor] = []
    for s in engine.state.optimizer_slices():
        own_lo, own_hi = s.bucket.shard_range(rank)
        lo, hi = max(own_lo, s.start), min(own_hi, s.end)
        for f in layout.fragments(s.bucket.index, lo, hi):
            name = layout.params[f.param].name
            block = blocks.get(name)
            if block is None and not first_tp:
                continue
            at = lo - s.start
            names = table.get(f.param, {}).get("elementwise", ())
            for kind, tensor in ((MASTER, s.master), *((state_kind(k), s.moments[k]) for k in names)):
                sources.append(tensor[at + f.local_start:at + f.local_end])
                key = f"{kind}/{name}/{f.param_start}" + (f"@{','.join(map(str, block.offsets))}" if block else "")
                items.append(Item(key=key, kind=kind, name=name, start=f.param_start, end=f.param_end,
                                  tensor=sources[-1], offsets=block.offsets if block else (),
                                  extent=block.extent if block else ()))
    # a whole-tensor optimizer steps only replicated parameters under TP (model_state refuses the rest)
    whole_state = optimizer.whole_state(saver_only=True) if first_tp else {}
    for param, state in sorted(whole_state.items()):
        name = layout.params[param].name
        for key, tensor in sorted(state.items()):
            kind = whole_kind(key)
            sources.append(tensor.reshape(-1))
            items.append(Item(key=f"{kind}/{name}/0", kind=kind, name=name, start=0, end=tensor.numel(),
                              tensor=sources[-1]))
    # One pass of (pinned, non-blocking on a GPU) copies: training goes on while they are written.
    items = [replace(item, tensor=value) for item, value in zip(items, host_copies(sources, dtype=torch.float32))]
    engine.state.evict_state()  # offloaded state read for the copies goes back to its files
    for generator, state in rng_states(engine.device).items():
        me = engine.rank  # restored by world rank
        items.append(Item(key=f"{RNG}/{generator}/{me}", kind=RNG, name=f"{generator}/{me}", start=0, end=0,
                          tensor=state.clone()))
    if rank == 0 and first_tp:
        for name, buf in persistent_buffers(engine.module).items():
            value = buf.detach().to("cpu", copy=True)
            value = value.float() if value.is_floating_point() else value
            items.append(Item(key=f"{BUFFER}/{name}", kind=BUFFER, name=name, start=0, end=value.numel(),
                              tensor=value))  # in its own shape: consolidation writes it as is
    return items


def describe_model(engine: OwnerEngine) -> dict[str, Any]:
    """The saving layout and model identity for the manifest (JSON data, no tensors)."""
    layout, module = engine.layout, engine.module
    aliases = _param_aliases(module)
    named = dict(module.named_parameters())
    state = engine.state
    names = [p.name for p in layout.params]
    shapes = _full_shapes(engine)
    params = [{"name": p.name, "aliases": aliases.get(id(named[p.name]), [p.name]), "shape": list(shapes[p.name]),
               "dtype": p.dtype, "bucket": p.bucket, "offset": p.offset, "trainable": state.trainable[p.index]}
              for p in layout.params]
    buckets = [{"index": b.index, "params": list(b.params), "numel": b.numel, "padded_numel": b.padded_numel,
                "shard_numel": b.shard_numel} for b in layout.buckets]
    return {"params": params, "buckets": buckets, "optimizers": state.optim_plan.records(names),
            "hyper": state.optimizer.hyper_state(), "param_state": table_by_name(state.optimizer.table(), names),
            "position": engine.position.to_data(), "tensor_parallel": engine.fabric.ranks.size,
            "loss_scaler": {"scale": engine.scaler.scale, "growth_tracker": engine.scaler.growth_tracker}}


def _full_shapes(engine: OwnerEngine) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape (a TP-sharded one's before the split), by name."""
    blocks = shard_blocks(engine.module)
    return {p.name: blocks[p.name].full if p.name in blocks else tuple(p.shape) for p in engine.layout.params}


class ShardSaver:
    """Writes snapshots on one background thread, one at a time, keyed by directory."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_ray-ckpt")
        self._writes: dict[str, tuple[Future[ShardFile | None], dict[str, Any]]] = {}

    def start(self, engine: OwnerEngine, directory: str) -> int:
        """Snapshot now, write under ``directory`` in the background; returns bytes to write
        (nothing where another shard group writes this rank's shard: ``wait`` gives None)."""
        items = snapshot(engine)
        model = describe_model(engine)  # as of the snapshot: training goes on meanwhile
        role = engine.fabric.save_role
        future: Future[ShardFile | None]
        if role.writes:
            future = self._pool.submit(_write_into, directory, shard_file_name(role.rank, role.world_size), items,
                                       role.rank)
        else:
            future = Future()
            future.set_result(None)
        self._writes[directory] = (future, model)
        return sum(it.tensor.numel() * it.tensor.element_size() for it in items)

    def wait(self, directory: str, *, timeout_s: float) -> tuple[ShardFile | None, dict[str, Any]]:
        """The durable file's record (None: this rank writes none) and the model description
        taken with the snapshot; raises what the write raised."""
        if directory not in self._writes:
            raise CheckpointError(f"no save into {directory} was started on this rank")
        future, model = self._writes[directory]
        try:
            return future.result(timeout=timeout_s), model
        except FutureTimeout as err:
            raise CheckpointError(f"writing this rank's file in {directory} took longer than {timeout_s:g}s") from err
        finally:
            if future.done():
                self._writes.pop(directory, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _write_into(directory: str, name: str, items: list[Item], rank: int) -> ShardFile:
    """Open ``directory`` (a path, or a URL this process opens itself) and write this rank's file
    there. Runs on the saver's thread: opening a store (the first time, its SDK) stalls no step."""
    storage, where = open_location(directory)
    return write_shard(storage, storage.join(where, name), items, rank=rank, name=name,
                       chunk_bytes=DEFAULT_CHUNK_BYTES)


def shard_record_json(record: ShardFile | None, extra: dict[str, Any]) -> str:
    return json.dumps({"file": asdict(record) if record is not None else None, **extra})


def optimizer_mismatch(manifest: Manifest, engine: OwnerEngine) -> str | None:
    """How this run's optimizers differ from those the checkpoint was saved with (classes,
    groups and their parameters), or None when they agree."""
    names = [p.name for p in engine.layout.params]
    ours = engine.state.optim_plan.records(names)
    saved = list(manifest.optimizers)
    mine = [str(o["type"]).rsplit(".", 1)[-1] for o in ours]
    if [o["type"] for o in saved] != [o["type"] for o in ours]:
        return f"it was saved with optimizers {manifest.optimizer_types} and this run builds {mine}"
    for k, (a, b) in enumerate(zip(saved, ours)):
        groups_a = [sorted(g["params"]) for g in a["groups"]]
        groups_b = [sorted(g["params"]) for g in b["groups"]]
        if groups_a != groups_b:
            return (f"optimizer {k} ({mine[k]}) was saved with {len(groups_a)} param groups of sizes "
                    f"{[len(g) for g in groups_a]} and this run builds {len(groups_b)} of sizes "
                    f"{[len(g) for g in groups_b]} (or other parameters in them)")
    return None


def restore(engine: OwnerEngine, path: str) -> int:
    """Overwrite this rank's state with the checkpoint at ``path``, read by the ranges this
    rank's layout needs. Returns bytes read. Nothing changes unless every read succeeded."""
    reader = CheckpointReader(path)
    m = reader.manifest
    layout, rank = engine.layout, engine.rank
    shapes = _full_shapes(engine)
    diff = model_mismatch(m, list(shapes.items()))
    if diff:
        raise CheckpointError(f"checkpoint {reader.path} is of a different model: {diff}")
    diff = optimizer_mismatch(m, engine)
    if diff:
        raise CheckpointError(f"checkpoint {reader.path} cannot resume this run's optimizers: {diff}. Pass the "
                              "optimizer factory it was saved with (from_checkpoint without optimizer= rebuilds it), "
                              "or start from its consolidated weights (ZeroConfig(init_state_dict=...)) to change "
                              "optimizers")
    reader.check_files()
    index = {p.name: p.index for p in layout.params}
    blocks = shard_blocks(engine.module)  # this rank's TP slices: what it reads of each sharded parameter
    optimizer = engine.state.optimizer
    table = table_from_names(m.param_state, index)
    # Everything is read (and verified) first; the live tensors change only afterwards.
    masters: list[tuple[torch.Tensor, torch.Tensor]] = []
    states: list[tuple[int, str, int, int, torch.Tensor]] = []  # group, state name, range, value
    for g, s in zip(engine.state.groups, engine.state.optimizer_slices()):
        for f in layout.fragments(s.bucket.index, s.start, s.end):
            name = layout.params[f.param].name
            block = blocks.get(name)
            masters.append((s.master[f.local_start:f.local_end], reader.read(MASTER, name, f.param_start,
                                                                            f.param_end, block)))
            if not g.policy.trainable:
                continue  # a parameter saved trained and frozen now keeps its values only
            for key in table.get(f.param, {}).get("elementwise", ()):
                states.append((g.index, key, f.local_start, f.local_end,
                               reader.read(state_kind(key), name, f.param_start, f.param_end, block)))
    whole: dict[int, dict[str, torch.Tensor]] = {}
    for param in optimizer.whole_params_here():
        name = layout.params[param].name
        for kind, shape in m.whole_kinds(name).items():
            value = reader.read(kind, name, 0, math.prod(shape)).view(shape)
            whole.setdefault(param, {})[kind.removeprefix(whole_kind(""))] = value
    buffers = persistent_buffers(engine.module)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, e in m.entries_of_kind(BUFFER):
        if e.name in buffers:
            value = reader.file(i).read_entry(e)
            staged.append((buffers[e.name].data.reshape(-1), value.reshape(-1)))
    # This rank number's generators as saved (a rank beyond the saving world keeps its seeded ones).
    rng = {generator: reader.file(saved[0][0]).read_entry(saved[0][1]) for generator in ("torch", "cuda")
           if (saved := m.entries(RNG, f"{generator}/{rank}"))}

    groups = {g.index: g for g in engine.state.groups}
    with torch.no_grad():
        for dest, value in masters + staged:
            dest.copy_(value)
        optimizer.reset()
        for group, key, lo, hi, value in states:
            groups[group].moment(key)[lo:hi].copy_(value)
    optimizer.load(table, whole)
    optimizer.load_hyper_state(m.hyper)
    engine.position = Position(step=m.step, samples_seen=m.samples_seen)
    engine.scaler.scale = float(m.loss_scaler.get("scale", engine.scaler.scale))
    engine.scaler.growth_tracker = int(m.loss_scaler.get("growth_tracker", 0))
    set_rng_states(rng, engine.device)
    engine.state.publish_masters()
    return reader.bytes_read
