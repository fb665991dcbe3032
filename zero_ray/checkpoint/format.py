"""The checkpoint format: a JSON manifest and one safetensors file per rank.

A checkpoint is a directory::

    step-00000042/
        manifest.json                        written last: a directory without it is unfinished
        rank-00000-of-00004.safetensors      rank 0's slices (plus the module's buffers)
        ...

Each rank file holds 1-D fp32 tensors, one per (kind, parameter fragment): ``master`` weights and
each element-wise optimizer state (``state.exp_avg``, ...) over elements ``[start, end)`` of the
flattened parameter; the whole-tensor optimizer state of the parameters it updated whole
(``whole.momentum_buffer``, ...: all of it, flattened); ``rng/torch`` and, on a GPU,
``rng/cuda`` (the rank's RNG states) and, on rank 0, ``buffer`` tensors. Because
entries are addressed by parameter name and element range, not by the saving run's buckets, any
layout (stage, world size, bucket size) reads exactly the ranges it needs: that is resharding.

With tensor parallelism (T > 1) a rank holds a slice of each sharded parameter: its entries carry
the slice's ``offsets`` and ``extent`` in every dimension of the whole tensor (whose shape the
``ParamRecord`` keeps), and ``[start, end)`` counts elements of the slice. A reader asks for a
range of its own slice (any T', or the whole tensor) and gets the overlapping pieces of whichever
saved slices hold them (``core/reshard_plan.overlaps``). A replicated parameter (a norm, an
embedding) is written by TP rank 0 only, as a whole tensor.

The manifest records every entry's file offset and every file's size, sha256 and the sha256 of
each ``chunk_bytes`` block, so a reader verifies the blocks it reads without reading the rest.

Pure: neither ray nor grpc nor torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from zero_ray.core.reshard_plan import Block, intersect, runs, span
from zero_ray.errors import CheckpointError

# 2: the user's torch.optim optimizers (state by name, whole-tensor state, schedulers).
# 3: the run's training configuration (``training``) and one position (step, samples_seen); the
#    engine's own optimizer-step count (``optimizer_steps``) is gone. Version 2 is still read:
#    its ``optimizer_steps`` is dropped and it records no training configuration.
# 4: the run's whole ZeroConfig (``config``), which a resume without a config restores; version 3
#    records only the settings that change the math.
# 5: tensor parallelism: entries of a TP-sharded parameter carry their slice's ``offsets`` and
#    ``extent``, and ``tensor_parallel`` records T. Versions 2-4 are read as T = 1.
FORMAT_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
DEFAULT_CHUNK_BYTES = 4 * 2**20

MASTER = "master"
BUFFER = "buffer"
RNG = "rng"
RNG_GENERATORS = ("torch", "cuda")  # rng/<generator>/<rank>: the CPU generator, a GPU owner's device generator
STATE_PREFIX = "state."  # element-wise optimizer state, by element range like the master
WHOLE_PREFIX = "whole."  # whole-tensor optimizer state, whole


def state_kind(name: str) -> str:
    return STATE_PREFIX + name


def whole_kind(name: str) -> str:
    return WHOLE_PREFIX + name


def shard_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One tensor in a rank file: elements ``[start, end)`` of ``kind`` of ``name``.

    ``offset`` is the file position of its first byte; ``dtype`` a safetensors dtype name;
    ``shape`` the stored tensor's shape (``(end - start,)`` for parameter fragments).
    ``offsets`` / ``extent``: the TP slice of the parameter that ``[start, end)`` counts in, per
    dimension of the whole tensor; empty for the whole tensor.
    """

    key: str
    kind: str
    name: str
    start: int
    end: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...] = ()
    extent: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.end - self.start

    def block(self, full: Sequence[int]) -> Block:
        """The slice of a parameter of shape ``full`` this entry counts its elements in."""
        if not self.offsets:
            return Block.whole(full)
        return Block(full=tuple(full), offsets=self.offsets, extent=self.extent)


@dataclass(frozen=True, kw_only=True)
class ShardFile:
    """One rank's file: its name in the checkpoint directory, size and checksums."""

    rank: int
    name: str
    size: int
    sha256: str
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]
    entries: tuple[Entry, ...]


@dataclass(frozen=True, kw_only=True)
class ParamRecord:
    """A parameter of the saved model: ``name`` as in ``named_parameters()``, every name it has in
    ``state_dict()`` (tied weights have several), shape, dtype, where the saving layout put it,
    and whether it was trained (a frozen parameter has master values only, no optimizer state)."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class BucketRecord:
    """A bucket of the saving layout; rank r owned ``[r * shard_numel, (r + 1) * shard_numel)``."""

    index: int
    params: tuple[int, ...]
    numel: int
    padded_numel: int
    shard_numel: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything about a checkpoint except the tensors."""

    format_version: int
    # The run's position (core/run_position.py): steps completed (skipped ones included) and their
    # samples; a resume continues from it.
    step: int
    samples_seen: int
    world_size: int  # the saving world: T x D owners, one file each
    stage: int
    compute_dtype: str
    seed: int
    params: tuple[ParamRecord, ...]
    buckets: tuple[BucketRecord, ...]
    # The user's optimizers: per optimizer its class ("type"), how it ran ("kind"), constructor
    # defaults and groups (hyperparameters as built, parameters by name).
    optimizers: tuple[Mapping[str, Any], ...]
    # What every rank held alike: each optimizer's current group hyperparameters (a scheduler
    # changes lr) and each scheduler's class and state_dict.
    hyper: Mapping[str, Any]
    # Per parameter with optimizer state: its scalars (e.g. step), element-wise state names and
    # whole-tensor state shapes (core/optim_state.py); a parameter without an entry had none.
    param_state: Mapping[str, Mapping[str, Any]]
    loss_scaler: Mapping[str, float]
    files: tuple[ShardFile, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    # The run's settings that change the math (``zero_ray.config.TRAINING_FIELDS`` as JSON data:
    # what a resume without a config restores and a config is compared with); empty in version 2.
    training: Mapping[str, Any] = field(default_factory=dict)
    # The run's whole ZeroConfig (``zero_ray.config_record``): what a resume without a config runs
    # with; empty before version 4.
    config: Mapping[str, Any] = field(default_factory=dict)
    # The saving run's tensor-parallel size T (its files hold TP slices: Entry.offsets); 1 before
    # version 5.
    tensor_parallel: int = 1
    # Not an __init__ argument, so dataclasses.replace() builds a fresh index for the new files.
    _index: dict[tuple[str, str], list[tuple[int, Entry]]] = field(default_factory=dict, init=False, compare=False,
                                                                   repr=False)
    _by_name: dict[str, ParamRecord] = field(default_factory=dict, init=False, compare=False, repr=False)

    # -- serialization ------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data.pop("_index")
        data.pop("_by_name")
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> Manifest:
        """Parse and check a manifest; ``where`` names the file in errors."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{where} is not valid JSON ({err}); the checkpoint is corrupt") from err
        version = data.get("format_version") if isinstance(data, dict) else None
        if version not in READABLE_VERSIONS:
            raise CheckpointError(f"{where}: format_version={version!r} is not supported; this zero_ray reads "
                                  f"format_version {' and '.join(map(str, READABLE_VERSIONS))} (upgrade zero_ray to "
                                  "read newer checkpoints)")
        if version == 2:
            data.pop("optimizer_steps", None)  # the engine's own count, no longer kept
        try:
            files = tuple(shard_file_from_data(f) for f in data.pop("files"))
            params = _param_records(data.pop("params"))
            buckets = _bucket_records(data.pop("buckets"))
            return cls(**{**data, "files": files, "params": params, "buckets": buckets,
                          "optimizers": tuple(data["optimizers"])})
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{where} lacks or misnames a field ({err!r}); the checkpoint is corrupt") from err

    # -- queries ------------------------------------------------------------------------------
    def kinds(self, name: str) -> tuple[str, ...]:
        """The kinds saved by element range for parameter ``name``: master, and its element-wise
        optimizer state (none when frozen or never stepped)."""
        entry = self.param_state.get(name, {})
        return (MASTER, *(state_kind(k) for k in entry.get("elementwise", ())))

    def whole_kinds(self, name: str) -> dict[str, tuple[int, ...]]:
        """Parameter ``name``'s whole-tensor state saved: kind -> shape."""
        entry = self.param_state.get(name, {})
        return {whole_kind(k): tuple(v["shape"]) for k, v in entry.get("whole", {}).items()}

    @property
    def optimizer_types(self) -> list[str]:
        """The saved optimizers' classes, short names (for messages)."""
        return [str(o.get("type", "?")).rsplit(".", 1)[-1] for o in self.optimizers]

    def param(self, name: str) -> ParamRecord:
        if not self._by_name:
            self._by_name.update((p.name, p) for p in self.params)
        try:
            return self._by_name[name]
        except KeyError:
            raise CheckpointError(f"the checkpoint has no parameter named {name!r}") from None

    def entries(self, kind: str, name: str) -> list[tuple[int, Entry]]:
        """``(file index, entry)`` of ``kind`` of ``name``, sorted by start."""
        if not self._index:
            for i, f in enumerate(self.files):
                for e in f.entries:
                    self._index.setdefault((e.kind, e.name), []).append((i, e))
            for v in self._index.values():
                v.sort(key=lambda ie: ie[1].start)
        return list(self._index.get((kind, name), ()))  # a copy: callers may extend it

    def entries_of_kind(self, kind: str) -> list[tuple[int, Entry]]:
        """``(file index, entry)`` of every entry of ``kind``."""
        return [(i, e) for i, f in enumerate(self.files) for e in f.entries if e.kind == kind]

    def pieces(self, kind: str, name: str, start: int, end: int, block: Block | None = None) -> list[Piece]:
        """The saved ranges that together cover elements ``[start, end)`` of ``kind`` of ``name``
        (counted in ``block``, a TP slice of the parameter; default the whole tensor): the read
        plan for one fragment of a new layout, by destination."""
        entries = self.entries(kind, name)
        if block is None and not any(e.offsets for _, e in entries):
            return self._flat_pieces(kind, name, start, end, entries)
        full = self._full_shape(kind, name, entries)
        want = block or Block.whole(full)
        if want.full != full:
            raise CheckpointError(f"{name!r} is {full} in the checkpoint but asked for as a slice of {want.full}")
        wanted, (lo, hi) = runs(want, start, end), span(want, start, end)
        found: list[Piece] = []
        for i, e in entries:
            have = e.block(full)
            have_lo, have_hi = span(have, e.start, e.end)
            if have_hi <= lo or hi <= have_lo:
                continue  # nowhere near: skip listing its runs (a rowwise slice has one per row)
            found += [Piece(file=i, entry=e, start=src, end=src + n, dest=dest)
                      for dest, src, n in intersect(wanted, start, runs(have, e.start, e.end), e.start)]
        out: list[Piece] = []
        pos = 0
        for p in sorted(found, key=lambda p: (p.dest, p.start - p.end)):
            skip = pos - p.dest  # a range already covered (a replicated value saved twice) is read once
            if skip < 0:
                break
            if skip < p.end - p.start:
                out.append(Piece(file=p.file, entry=p.entry, start=p.start + skip, end=p.end, dest=pos))
                pos = p.dest + p.end - p.start
        if pos == end - start:
            return out
        raise CheckpointError(f"the checkpoint lacks {kind} of {name!r} elements [{start + pos}, {end}) (of "
                              f"[{start}, {end}) asked for, in its slice {want}); the manifest is incomplete or the "
                              "optimizer differs")

    def _full_shape(self, kind: str, name: str, entries: list[tuple[int, Entry]]) -> tuple[int, ...]:
        """The whole shape of what ``kind`` of ``name`` counts elements of: the parameter's (a
        whole-tensor state is whole, so its stored shape)."""
        if kind == MASTER or kind.startswith(STATE_PREFIX):
            return tuple(self.param(name).shape)
        return tuple(entries[0][1].shape) if entries else ()

    def _flat_pieces(self, kind: str, name: str, start: int, end: int,
                     entries: list[tuple[int, Entry]]) -> list[Piece]:
        """``pieces`` where every entry holds a flat range of the whole tensor (T = 1)."""
        out: list[Piece] = []
        pos = start
        for i, e in entries:
            lo, hi = max(pos, e.start), min(end, e.end)
            if lo >= hi:
                continue
            if lo != pos:
                break
            out.append(Piece(file=i, entry=e, start=lo - e.start, end=hi - e.start, dest=lo - start))
            pos = hi
            if pos == end:
                return out
        if start == end:
            return out
        raise CheckpointError(f"the checkpoint lacks {kind} of {name!r} elements [{pos}, {end}) (of [{start}, {end}) "
                              f"asked for); the manifest is incomplete or the optimizer differs")


def _param_records(data: Iterable[Mapping[str, Any]]) -> tuple[ParamRecord, ...]:
    return tuple(ParamRecord(**{**p, "aliases": tuple(p["aliases"]), "shape": tuple(p["shape"])}) for p in data)


def _bucket_records(data: Iterable[Mapping[str, Any]]) -> tuple[BucketRecord, ...]:
    return tuple(BucketRecord(**{**b, "params": tuple(b["params"])}) for b in data)


def shard_file_from_data(data: Mapping[str, Any]) -> ShardFile:
    """A ``ShardFile`` from its ``dataclasses.asdict`` form (as an owner reports it)."""
    return ShardFile(**{**data, "chunk_sha256": tuple(data["chunk_sha256"]),
                        "entries": tuple(Entry(**{**e, "shape": tuple(e["shape"]),
                                                  "offsets": tuple(e.get("offsets", ())),
                                                  "extent": tuple(e.get("extent", ()))})
                                         for e in data["entries"])})


def build_manifest(*, models: Sequence[Mapping[str, Any]], files: Sequence[ShardFile], step: int,
                   samples_seen: int, world_size: int, stage: int, compute_dtype: str, seed: int,
                   extra: Mapping[str, Any] | None = None, training: Mapping[str, Any] | None = None,
                   config: Mapping[str, Any] | None = None) -> Manifest:
    """The manifest of a save: ``models`` are every rank's description (``models[0]``'s layout,
    optimizers and counters, which every rank shares; the parameters' optimizer state entries
    merged over ranks, each rank knowing those of what it updates), ``files`` every rank's record."""
    model = models[0]
    param_state: dict[str, Any] = {}
    for m in models:
        for name, entry in m["param_state"].items():
            param_state.setdefault(name, entry)
    return Manifest(
        format_version=FORMAT_VERSION, step=step, samples_seen=samples_seen, world_size=world_size, stage=stage,
        compute_dtype=compute_dtype, seed=seed,
        params=_param_records(model["params"]), buckets=_bucket_records(model["buckets"]),
        optimizers=tuple(model["optimizers"]), hyper=dict(model["hyper"]),
        param_state=dict(sorted(param_state.items())), loss_scaler=dict(model["loss_scaler"]),
        files=tuple(sorted(files, key=lambda f: f.rank)), extra=dict(extra or {}), training=dict(training or {}),
        config=dict(config or {}), tensor_parallel=int(model.get("tensor_parallel", 1)))


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Read elements ``[start, end)`` of ``entry`` (in ``files[file]``) into ``dest`` onward."""

    file: int
    entry: Entry
    start: int
    end: int
    dest: int


def model_mismatch(manifest: Manifest, specs: Sequence[tuple[str, Sequence[int]]]) -> str | None:
    """How the model being built (``(name, shape)`` in registration order) differs from the
    checkpoint's, or None when they agree: names only on one side and shapes that differ."""
    saved = {p.name: tuple(p.shape) for p in manifest.params}
    model = {name: tuple(shape) for name, shape in specs}
    only_saved = sorted(set(saved) - set(model))
    only_model = sorted(set(model) - set(saved))
    shapes = [(n, saved[n], model[n]) for n in saved if n in model and saved[n] != model[n]]
    if not (only_saved or only_model or shapes):
        return None
    parts = []
    if only_saved:
        parts.append(f"only in the checkpoint: {_clip(only_saved)}")
    if only_model:
        parts.append(f"only in the model: {_clip(only_model)}")
    if shapes:
        parts.append(f"shapes differ (name, checkpoint, model): {_clip(shapes)}")
    return "; ".join(parts)


def _clip(items: Iterable[Any], limit: int = 20) -> str:
    items = list(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{items[:limit]}{more}"
