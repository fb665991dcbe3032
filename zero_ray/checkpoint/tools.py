"""Offline tools on a committed checkpoint: inspect (and verify) it, reshard it for another world
size, consolidate it into one standard safetensors state dict.

Each reads through ``CheckpointReader`` (every block it uses is verified) and holds at most one
rank's shard (reshard) or one buffer of elements (consolidate) in memory, never the model.
Inputs and outputs are anything ``location.open_location`` opens: local paths, URLs
(``s3://...``), or paths in the ``filesystem`` passed (the same one for input and output).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import (
    BUFFER,
    DEFAULT_CHUNK_BYTES,
    MASTER,
    RNG,
    RNG_GENERATORS,
    STATE_PREFIX,
    WHOLE_PREFIX,
    BucketRecord,
    Manifest,
    shard_file_name,
)
from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.shardfile import Item, safetensors_header, tensor_bytes, write_shard
from zero_ray.checkpoint.storage import LocalStorage, Storage
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.errors import CheckpointError

# Elements consolidate copies at a time: its memory bound besides the reader's verified blocks.
CONSOLIDATE_CHUNK_NUMEL = 4 * 2**20


# -- inspect ------------------------------------------------------------------------------------------
def _output(out: str | os.PathLike[str], storage: Storage | None, filesystem: Any) -> tuple[Storage, str]:
    """Where a tool writes: on ``storage`` when given, else wherever ``out`` names."""
    return (storage, os.fspath(out)) if storage is not None else open_location(out, filesystem=filesystem)


def inspect_checkpoint(path: str, *, verify: bool = False, storage: Storage | None = None,
                       filesystem: Any = None) -> dict[str, Any]:
    """What the checkpoint at ``path`` (a checkpoint or a root with ``latest``) holds, as JSON
    data. With ``verify`` every file is read and every block checksum and the whole-file sha256
    checked first; any damage raises ``CheckpointError`` naming the file."""
    reader = CheckpointReader(path, storage=storage, filesystem=filesystem)
    m = reader.manifest
    if verify:
        reader.check_files()  # missing and truncated files fail before any long read
        for i in range(len(m.files)):
            reader.file(i).verify()
    return {
        "path": reader.path,
        "format_version": m.format_version,
        "step": m.step,
        "samples_seen": m.samples_seen,
        "training": dict(m.training),
        "config": dict(m.config),
        "stage": m.stage,
        "world_size": m.world_size,
        "tensor_parallel": m.tensor_parallel,
        "compute_dtype": m.compute_dtype,
        "seed": m.seed,
        "optimizers": [{"type": o["type"], "kind": o["kind"], "groups": len(o["groups"])} for o in m.optimizers],
        "schedulers": [s["type"] for s in m.hyper.get("schedulers", [])],
        "state": sorted({k for e in m.param_state.values() for k in (*e.get("elementwise", ()), *e.get("whole", {}))}),
        "loss_scaler": dict(m.loss_scaler),
        "params": len(m.params),
        "elements": sum(p.numel for p in m.params),
        "trainable_elements": sum(p.numel for p in m.params if p.trainable),
        "buckets": len(m.buckets),
        "buffers": len(m.entries_of_kind(BUFFER)),
        "extra": dict(m.extra),
        "files": [{"rank": f.rank, "name": f.name, "size": f.size, "sha256": f.sha256} for f in m.files],
        "bytes": sum(f.size for f in m.files),
        "verified": verify,
    }


# -- reshard ------------------------------------------------------------------------------------------
def layout_of(manifest: Manifest, world_size: int) -> FlatLayout:
    """The saving run's buckets (same parameter groups, same order) padded for ``world_size``."""
    specs = [(p.name, p.shape, p.dtype) for p in manifest.params]
    return FlatLayout.build(specs, world_size=world_size, groups=[b.params for b in manifest.buckets])


def _rank_items(reader: CheckpointReader, layout: FlatLayout, rank: int) -> list[Item]:
    """Everything rank ``rank`` of ``layout`` would have saved, read from ``reader``: master and
    element-wise optimizer state of its shard range (in the order an owner writes them), on the
    rank its parameters' bucket shards put first the whole-tensor state (where it lands matters
    not: readers find it by name), its RNG states if the saving run had that rank, and on rank 0
    the module's buffers and the RNG states of saving ranks the new layout lacks (kept so that
    resharding back restores them)."""
    m = reader.manifest
    items: list[Item] = []
    for bucket in layout.buckets:
        for f in layout.shard_fragments(bucket.index, rank):
            name = layout.params[f.param].name
            for kind in m.kinds(name):
                items.append(Item(key=f"{kind}/{name}/{f.param_start}", kind=kind, name=name, start=f.param_start,
                                  end=f.param_end, tensor=reader.read(kind, name, f.param_start, f.param_end)))
            if f.param_start == 0:  # the rank holding a parameter's first element takes its whole state
                for kind, shape in m.whole_kinds(name).items():
                    numel = math.prod(shape)
                    items.append(Item(key=f"{kind}/{name}/0", kind=kind, name=name, start=0, end=numel,
                                      tensor=reader.read(kind, name, 0, numel)))
    copied = [ie for g in RNG_GENERATORS for ie in m.entries(RNG, f"{g}/{rank}")]
    if rank == 0:
        copied += [(i, e) for i, e in m.entries_of_kind(RNG) if e.name not in _rng_names(layout.world_size)]
        copied += m.entries_of_kind(BUFFER)
    for i, e in copied:
        items.append(Item(key=e.key, kind=e.kind, name=e.name, start=e.start, end=e.end,
                          tensor=reader.file(i).read_entry(e)))
    return items


def _rng_names(world_size: int) -> set[str]:
    return {f"{g}/{rank}" for g in RNG_GENERATORS for rank in range(world_size)}


def reshard(path: str, out: str, *, world_size: int, keep: int | None = None,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, storage: Storage | None = None, filesystem: Any = None) -> str:
    """Rewrite the checkpoint at ``path`` as a committed checkpoint under the root ``out`` laid
    out for ``world_size`` ranks; returns its directory. Loads exactly as the source does. A
    checkpoint saved with tensor parallelism is written whole-tensor (T = 1): any T reads it.

    One new rank's shard is in memory at a time. The result is published atomically (the
    source is never touched); ``keep`` prunes older checkpoints under ``out`` (default: none)."""
    if world_size < 1:
        raise CheckpointError(f"reshard needs world_size >= 1, not {world_size}")
    reader = CheckpointReader(path, storage=storage, filesystem=filesystem)
    out_storage, out = _output(out, storage, filesystem)
    if _same_place(out_storage, out, reader.storage, reader.path):
        raise CheckpointError(f"reshard's output {out} is the checkpoint being read; pass a checkpoint root such as "
                              "its parent or a new directory")
    m = reader.manifest
    unknown = sorted({e.kind for f in m.files for e in f.entries if e.kind not in (MASTER, RNG, BUFFER)
                      and not e.kind.startswith((STATE_PREFIX, WHOLE_PREFIX))})
    if unknown:
        raise CheckpointError(f"{reader.path} holds entries of kinds {unknown} this zero_ray cannot place in a new "
                              "layout; reshard it with the zero_ray version that wrote it")
    reader.check_files()  # a missing or truncated file fails before anything is written
    layout = layout_of(m, world_size)
    pending = store.begin(out, m.step, storage=out_storage)
    try:
        files = []
        for rank in range(world_size):
            name = shard_file_name(rank, world_size)
            files.append(write_shard(out_storage, out_storage.join(pending.tmp, name),
                                     _rank_items(reader, layout, rank), rank=rank, name=name,
                                     chunk_bytes=chunk_bytes))
        params = tuple(dataclasses.replace(p, bucket=s.bucket, offset=s.offset)
                       for p, s in zip(m.params, layout.params))
        buckets = tuple(BucketRecord(index=b.index, params=b.params, numel=b.numel, padded_numel=b.padded_numel,
                                     shard_numel=b.shard_numel) for b in layout.buckets)
        manifest = dataclasses.replace(m, world_size=world_size, params=params, buckets=buckets, files=tuple(files),
                                       tensor_parallel=1)
        return store.commit(pending, manifest, keep=sys.maxsize if keep is None else keep, storage=out_storage)
    except BaseException:
        store.abandon(pending, storage=out_storage)
        raise


def _same_place(a_storage: Storage, a: str, b_storage: Storage, b: str) -> bool:
    if isinstance(a_storage, LocalStorage) and isinstance(b_storage, LocalStorage):
        return os.path.abspath(a) == os.path.abspath(b)
    return a_storage.locate(a).rstrip("/") == b_storage.locate(b).rstrip("/")


# -- consolidate --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of the consolidated state dict and how to read elements ``[start, end)`` of it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    read: Callable[[int, int], torch.Tensor]


def _state_dict_plan(reader: CheckpointReader, *, aliases: bool = True) -> list[_Tensor]:
    """Every tensor of the module's state dict: each parameter under every name it has (tied
    weights have several; with ``aliases=False`` under its ``named_parameters()`` name only, as
    ``save_pretrained`` writes tied weights once), then the buffers (rank 0 saved them whole)."""
    m = reader.manifest
    plan = [_Tensor(alias, "F32", p.shape, functools.partial(reader.read, MASTER, p.name))
            for p in m.params for alias in dict.fromkeys((p.name, *(p.aliases if aliases else ())))]
    plan += [_Tensor(e.name, e.dtype, e.shape, functools.partial(reader.file(i).read, e))
             for i, e in m.entries_of_kind(BUFFER)]
    twice = sorted(k for k, n in collections.Counter(t.key for t in plan).items() if n > 1)
    if twice:
        raise CheckpointError(f"{reader.path}: the names {twice} belong to more than one saved tensor; the manifest "
                              "is corrupt")
    return plan


def _write_safetensors(storage: Storage, out: str, plan: list[_Tensor], *, chunk_numel: int,
                       dtype: str | None = None) -> int:
    """Write ``plan`` as one safetensors file ``out`` (floating tensors converted to ``dtype``
    when given), streaming ``chunk_numel`` elements at a time; it appears complete or not at
    all (``Storage.open_replace``: temp file, fsync and rename; one upload on an object store).
    Returns the bytes of tensor data."""
    def target(t: _Tensor) -> str:
        return dtype if dtype is not None and t.dtype in _FLOATS else t.dtype

    head, _ = safetensors_header([(t.key, target(t), t.shape) for t in plan])
    written = 0
    with storage.open_replace(out) as fh:
        fh.write(head)
        for t in plan:
            numel = math.prod(t.shape)
            for start in range(0, numel, chunk_numel):
                values = t.read(start, min(numel, start + chunk_numel))
                if target(t) != t.dtype:
                    values = values.to(_FLOATS[target(t)])
                data = tensor_bytes(values)
                fh.write(data)
                written += len(data)
    return written


def consolidate(path: str, out: str, *, chunk_numel: int = CONSOLIDATE_CHUNK_NUMEL,
                storage: Storage | None = None, filesystem: Any = None) -> str:
    """Write the checkpoint at ``path`` as one safetensors file ``out``: the full fp32 state dict
    under the module's own names, which ``module.load_state_dict(safetensors.torch.load_file(out))``
    accepts. Returns ``out``.

    Streams: the header goes first (offsets follow from shapes and dtypes), then each tensor
    ``chunk_numel`` elements at a time, so memory stays at one chunk plus the reader's verified
    blocks. ``out`` appears complete or not at all (temp file, fsync, rename)."""
    reader = CheckpointReader(path, storage=storage, filesystem=filesystem)
    reader.check_files()  # a missing or truncated file fails before anything is written
    out_storage, out = _output(out, storage, filesystem)
    _write_safetensors(out_storage, out, _state_dict_plan(reader), chunk_numel=chunk_numel)
    return out


# -- export (Hugging Face layout) -----------------------------------------------------------------------
_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


def parse_size(text: str | int) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a number of bytes, as ``save_pretrained``'s max_shard_size."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        raw = str(text).strip().upper()
        unit = next((u for u in units if raw.endswith(u)), "")
        try:
            value = int(float(raw[:len(raw) - len(unit)]) * units.get(unit, 1))
        except ValueError:
            raise CheckpointError(f"max_shard_size={text!r} is not a size; write e.g. '5GB', '500MB' or bytes") from None
    if value < 1:
        raise CheckpointError(f"max_shard_size={text!r} must be at least one byte")
    return value


def export_pretrained(path: str, out_dir: str, *, max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
                      dtype: str | None = None, chunk_numel: int = CONSOLIDATE_CHUNK_NUMEL,
                      storage: Storage | None = None, filesystem: Any = None) -> list[str]:
    """Write the checkpoint at ``path`` into ``out_dir`` as Hugging Face ``save_pretrained``
    writes weights: ``model.safetensors``, or above ``max_shard_size`` shards named
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (``total_size`` and
    a ``weight_map``). Tied weights appear once, under their ``named_parameters()`` name; the
    persistent buffers are included. ``dtype`` ("float32", "bfloat16", "float16") converts the
    floating tensors (default: as saved, fp32). Streams with bounded memory, as ``consolidate``.
    With the model's ``config.json`` in ``out_dir``, ``from_pretrained(out_dir)`` loads it.
    Returns the files written."""
    if dtype is not None and dtype not in _EXPORT_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not one of {sorted(_EXPORT_DTYPES)}")
    limit = parse_size(max_shard_size)
    reader = CheckpointReader(path, storage=storage, filesystem=filesystem)
    reader.check_files()
    out_storage, out_dir = _output(out_dir, storage, filesystem)
    plan = _state_dict_plan(reader, aliases=False)
    target = _EXPORT_DTYPES.get(dtype or "", None)
    sizes = [math.prod(t.shape) * (_FLOATS[target].itemsize if target and t.dtype in _FLOATS
                                  else _FLOATS.get(t.dtype, torch.float32).itemsize) for t in plan]
    shards: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    out_storage.makedirs(out_dir)
    for stale in out_storage.listdir(out_dir):  # a previous export's layout must not mix with this one
        if stale in (WEIGHTS_NAME, INDEX_NAME) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale):
            out_storage.remove(out_storage.join(out_dir, stale))
    if len(shards) == 1:
        out = out_storage.join(out_dir, WEIGHTS_NAME)
        _write_safetensors(out_storage, out, plan, chunk_numel=chunk_numel, dtype=target)
        return [out]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    written, weight_map = [], {}
    for name, members in zip(names, shards):
        out = out_storage.join(out_dir, name)
        _write_safetensors(out_storage, out, [plan[i] for i in members], chunk_numel=chunk_numel, dtype=target)
        written.append(out)
        weight_map.update({plan[i].key: name for i in members})
    index = out_storage.join(out_dir, INDEX_NAME)
    out_storage.write_atomic(index, json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
                                               indent=2, sort_keys=True).encode())
    return [*written, index]
