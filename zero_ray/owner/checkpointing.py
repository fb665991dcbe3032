"""One rank's side of a checkpoint: snapshot its slices, write them in the background, and
restore the ranges a (possibly different) layout needs.

Saving copies every slice this rank owns to host memory (the only part that stalls training)
and writes the rank file on a background thread; the driver commits the checkpoint once every
rank's file is durable. With a replicated optimizer (stage 0) every rank holds everything, so
each saves only its own shard range: no element is written twice.

Restoring reads, for every range this rank updates in the new layout, the saved pieces that
cover it; everything is read and verified before any live tensor changes.
"""

from __future__ import annotations

import json
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
    ShardFile,
    model_mismatch,
    shard_file_name,
)
from zero_ray.checkpoint.shardfile import Item, write_shard
from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.core.optim import takes_weight_decay
from zero_ray.errors import CheckpointError
from zero_ray.owner.engine import OwnerEngine
from zero_ray.owner.host_copy import host_copies


def _param_aliases(module: torch.nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that ``state_dict()`` contains (parameters excluded)."""
    params = {n for names in _param_aliases(module).values() for n in names}
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in params}


def snapshot(engine: OwnerEngine) -> list[Item]:
    """This rank's saved tensors as host copies: master weights and moments of every element it
    owns, its RNG state, and (rank 0) the module's buffers."""
    rank, layout = engine.rank, engine.layout
    items: list[Item] = []
    sources: list[torch.Tensor] = []
    for s in engine.state.optimizer_slices():
        own_lo, own_hi = s.bucket.shard_range(rank)
        lo, hi = max(own_lo, s.start), min(own_hi, s.end)
        for f in layout.fragments(s.bucket.index, lo, hi):
            name = layout.params[f.param].name
            at = lo - s.start
            for kind, tensor in ((MASTER, s.master), *s.moments.items()):
                sources.append(tensor[at + f.local_start:at + f.local_end])
                items.append(Item(key=f"{kind}/{name}/{f.param_start}", kind=kind, name=name, start=f.param_start,
                                  end=f.param_end, tensor=sources[-1]))
    # One pass of (pinned, non-blocking on a GPU) copies: training goes on while they are written.
    items = [replace(item, tensor=value) for item, value in zip(items, host_copies(sources, dtype=torch.float32))]
    items.append(Item(key=f"{RNG}/torch/{rank}", kind=RNG, name=f"torch/{rank}", start=0, end=0,
                      tensor=torch.get_rng_state().clone()))
    if rank == 0:
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
    opt = engine.spec.optimizer
    state = engine.state
    params = [{"name": p.name, "aliases": aliases.get(id(named[p.name]), [p.name]), "shape": list(p.shape),
               "dtype": p.dtype, "bucket": p.bucket, "offset": p.offset, "trainable": state.trainable[p.index]}
              for p in layout.params]
    buckets = [{"index": b.index, "params": list(b.params), "numel": b.numel, "padded_numel": b.padded_numel,
                "shard_numel": b.shard_numel} for b in layout.buckets]
    trained = [p for p in layout.params if state.trainable[p.index]]
    decay = [p.name for p in trained if takes_weight_decay(p.name, p.shape, opt.no_decay)]
    no_decay = sorted({p.name for p in trained} - set(decay))
    steps = {p.name: state.param_steps[p.index] for p in trained if state.param_steps[p.index] != engine.steps_done}
    return {"params": params, "buckets": buckets, "param_groups": {"decay": decay, "no_decay": no_decay},
            "moments": list(opt.state_names), "optimizer_steps": engine.steps_done, "param_steps": steps,
            "loss_scaler": {"scale": engine.scaler.scale, "growth_tracker": engine.scaler.growth_tracker}}


class ShardSaver:
    """Writes snapshots on one background thread, one at a time, keyed by directory."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_ray-ckpt")
        self._writes: dict[str, tuple[Future[ShardFile], dict[str, Any]]] = {}

    def start(self, engine: OwnerEngine, directory: str) -> int:
        """Snapshot now, write under ``directory`` in the background; returns bytes to write."""
        items = snapshot(engine)
        model = describe_model(engine)  # as of the snapshot: training goes on meanwhile
        rank, n = engine.rank, engine.world_size
        future = self._pool.submit(_write_into, directory, shard_file_name(rank, n), items, rank)
        self._writes[directory] = (future, model)
        return sum(it.tensor.numel() * it.tensor.element_size() for it in items)

    def wait(self, directory: str, *, timeout_s: float) -> tuple[ShardFile, dict[str, Any]]:
        """The durable file's record and the model description taken with the snapshot;
        raises what the write raised."""
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


def shard_record_json(record: ShardFile, extra: dict[str, Any]) -> str:
    return json.dumps({"file": asdict(record), **extra})


def restore(engine: OwnerEngine, path: str) -> int:
    """Overwrite this rank's state with the checkpoint at ``path``, read by the ranges this
    rank's layout needs. Returns bytes read. Nothing changes unless every read succeeded."""
    reader = CheckpointReader(path)
    m = reader.manifest
    layout, rank = engine.layout, engine.rank
    diff = model_mismatch(m, [(p.name, p.shape) for p in layout.params])
    if diff:
        raise CheckpointError(f"checkpoint {reader.path} is of a different model: {diff}")
    needed = tuple(engine.spec.optimizer.state_names)
    missing = [k for k in needed if k not in m.moments]
    if missing:
        raise CheckpointError(f"checkpoint {reader.path} has no optimizer state {missing} (it saved {list(m.moments)} "
                              f"for {m.optimizer.get('type')}); resume with the same optimizer, or start from its "
                              "consolidated weights (ZeroConfig(init_state_dict=...)) to change optimizers")
    reader.check_files()
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in engine.state.optimizer_slices():
        for f in layout.fragments(s.bucket.index, s.start, s.end):
            name = layout.params[f.param].name
            saved = m.param(name).kinds(m.moments)
            for kind, tensor in ((MASTER, s.master), *s.moments.items()):
                dest = tensor[f.local_start:f.local_end]
                # A parameter saved frozen and trained now starts its optimizer state afresh.
                value = (reader.read(kind, name, f.param_start, f.param_end) if kind in saved
                         else torch.zeros(dest.shape, dtype=torch.float32))
                staged.append((dest, value))
    buffers = persistent_buffers(engine.module)
    for i, e in m.entries_of_kind(BUFFER):
        if e.name in buffers:
            value = reader.file(i).read_entry(e)
            staged.append((buffers[e.name].data.reshape(-1), value.reshape(-1)))
    rng = m.entries(RNG, f"torch/{rank}")
    rng_state = reader.file(rng[0][0]).read_entry(rng[0][1]) if rng else None

    with torch.no_grad():
        for dest, value in staged:
            dest.copy_(value)
    engine.steps_done = m.optimizer_steps
    state = engine.state
    state.param_steps = [m.steps_of(p.name) if state.trainable[p.index] else 0 for p in layout.params]
    engine.scaler.scale = float(m.loss_scaler.get("scale", engine.scaler.scale))
    engine.scaler.growth_tracker = int(m.loss_scaler.get("growth_tracker", 0))
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    engine.state.publish_masters()
    return reader.bytes_read
