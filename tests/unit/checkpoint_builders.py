"""Checkpoints written as a run's owners would write them, without Ray: a module's parameters laid
out with ``FlatLayout`` at world size N, each rank's file holding its shard range's fragments of
master weights and element-wise optimizer state (plus its RNG state, and the buffers on rank 0),
then committed."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch

from zero_ray.checkpoint import store
from zero_ray.config import ZeroConfig, training_record
from zero_ray.config_record import config_record
from zero_ray.checkpoint.format import BUFFER, MASTER, RNG, build_manifest, shard_file_name, state_kind
from zero_ray.checkpoint.shardfile import Item, write_shard
from zero_ray.checkpoint.storage import LocalStorage, Storage
from zero_ray.core.flat_layout import FlatLayout

ADAM = (state_kind("exp_avg"), state_kind("exp_avg_sq"))


@dataclass(frozen=True, kw_only=True)
class Saved:
    """A committed checkpoint and the full values it holds: ``values[(kind, name)]`` is the
    flattened master or moment of a parameter, or a buffer."""

    path: str
    layout: FlatLayout
    values: dict[tuple[str, str], torch.Tensor]


def model_values(module: torch.nn.Module, moments: tuple[str, ...]) -> dict[tuple[str, str], torch.Tensor]:
    """What a checkpoint of ``module`` holds: its parameters as masters, made-up moments (seeded by
    name, so every rank agrees), and its buffers."""
    values: dict[tuple[str, str], torch.Tensor] = {}
    for name, p in module.named_parameters():
        values[(MASTER, name)] = p.detach().float().reshape(-1).clone()
        for kind in moments:
            g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{name}".encode()))
            values[(kind, name)] = torch.rand(p.numel(), generator=g)
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    for name, buf in module.state_dict().items():
        if name not in params:
            values[(BUFFER, name)] = (buf.float() if buf.is_floating_point() else buf).reshape(-1).clone()
    return values


def _rank_items(layout: FlatLayout, rank: int, values: dict[tuple[str, str], torch.Tensor],
                moments: tuple[str, ...]) -> list[Item]:
    items = []
    for b in layout.buckets:
        for f in layout.shard_fragments(b.index, rank):
            name = layout.params[f.param].name
            items += [Item(key=f"{kind}/{name}/{f.param_start}", kind=kind, name=name, start=f.param_start,
                           end=f.param_end, tensor=values[(kind, name)][f.param_start:f.param_end].clone())
                      for kind in (MASTER, *moments)]
    state = torch.Generator().manual_seed(rank).get_state()
    items.append(Item(key=f"{RNG}/torch/{rank}", kind=RNG, name=f"torch/{rank}", start=0, end=0, tensor=state))
    if rank == 0:
        items += [Item(key=f"{BUFFER}/{name}", kind=BUFFER, name=name, start=0, end=v.numel(), tensor=v)
                  for (kind, name), v in values.items() if kind == BUFFER]
    return items


def describe(module: torch.nn.Module, layout: FlatLayout, moments: tuple[str, ...]) -> dict:
    """The ``model`` description an owner reports for the manifest (an AdamW with decay and
    no-decay groups that has stepped every parameter three times)."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    named = dict(module.named_parameters())
    return {
        "params": [{"name": p.name, "aliases": aliases[id(named[p.name])], "shape": list(p.shape), "dtype": p.dtype,
                    "bucket": p.bucket, "offset": p.offset} for p in layout.params],
        "buckets": [{"index": b.index, "params": list(b.params), "numel": b.numel, "padded_numel": b.padded_numel,
                     "shard_numel": b.shard_numel} for b in layout.buckets],
        "optimizers": [{"type": "torch.optim.adamw.AdamW", "kind": "elementwise", "defaults": {"lr": 1e-3},
                        "groups": [{"hyper": {"weight_decay": 0.01},
                                    "params": [p.name for p in layout.params if len(p.shape) > 1]},
                                   {"hyper": {"weight_decay": 0.0},
                                    "params": [p.name for p in layout.params if len(p.shape) <= 1]}]}],
        "hyper": {"optimizers": [[{"lr": 1e-3}, {"lr": 1e-3}]], "schedulers": []},
        "param_state": {p.name: {"scalars": {"step": ["tensor", "float32", 3.0, False]},
                                 "elementwise": [k.removeprefix("state.") for k in moments], "whole": {}}
                        for p in layout.params},
        "position": {"step": 3, "samples_seen": 36}, "loss_scaler": {"scale": 1.0, "growth_tracker": 0},
    }


def save(module: torch.nn.Module, root: str | os.PathLike[str], *, world_size: int, bucket_numel: int = 50,
         moments: tuple[str, ...] = ADAM, step: int = 3, chunk_bytes: int = 64, keep: int = 3,
         storage: Storage | None = None, groups: list[list[int]] | None = None) -> Saved:
    """Write and commit a checkpoint of ``module`` as ``world_size`` ranks would save it
    (small blocks, so that reads span several of them). ``groups``: the buckets' parameter
    indices (stage 3 lays out one bucket per unit), instead of buckets of ``bucket_numel``."""
    storage = storage or LocalStorage()
    specs = [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in module.named_parameters()]
    layout = (FlatLayout.build(specs, world_size=world_size, groups=groups) if groups is not None
              else FlatLayout.by_size(specs, world_size=world_size, bucket_numel=bucket_numel))
    values = model_values(module, moments)
    pending = store.begin(os.fspath(root), step, storage=storage)
    files = []
    for rank in range(world_size):
        name = shard_file_name(rank, world_size)
        files.append(write_shard(storage, storage.join(pending.tmp, name), _rank_items(layout, rank, values, moments),
                                 rank=rank, name=name, chunk_bytes=chunk_bytes))
    manifest = build_manifest(models=[describe(module, layout, moments)], files=files, step=step,
                              samples_seen=12 * step, world_size=world_size, stage=2, compute_dtype="float32",
                              seed=0, training=training_record(ZeroConfig()),
                              config=config_record(ZeroConfig(world_size=world_size)))
    return Saved(path=store.commit(pending, manifest, keep=keep, storage=storage), layout=layout, values=values)


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one bit of the file at ``offset``, as a bad disk or a bad copy would."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
