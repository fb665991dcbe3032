"""How a global batch reaches the owners: the pieces a Step or Evaluate request names.

``StagedBatch`` (``step(batch)``, ``evaluate(batch)``): the driver holds the batch, splits it
along dim 0 and puts each owner's piece in Ray's object store; the reference goes to its owner
in a Ray call, which Ray resolves and reference-counts, and the request names it by key. The
driver drops its references once the step is over and the object is freed: no out-of-band
ObjectRef, so nothing is pinned.

``IndexedBatch`` (``fit``): each owner holds the dataset; the request carries that owner's
indices and the owner builds its piece. The driver keeps no batches, only indices.

``Replay`` keeps the last steps' global batches by step index, for a restore to send again.

With tensor parallelism of size T the batch is cut for the D = world_size / T data-parallel
ranks, and every owner of a TP group (ranks ``d T .. d T + T - 1``) gets data-parallel rank
``d``'s piece: one object staged to all T of them, or the same indices
(``core/tensor_parallel_ranks.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import ray

from zero_ray.control.handlers import EvaluateArgs, Piece, RelayEvaluateArgs, RelayStepArgs, StepArgs
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
from zero_ray.errors import ConfigError

V = TypeVar("V")


@functools.lru_cache(maxsize=16)
def rank_table(world_size: int, tensor_parallel: int) -> TensorParallelRanks:
    """The TP rank table of a membership, built (and checked) once per (world size, T) rather
    than every step; an invalid pair raises every time (lru_cache keeps no exception)."""
    return TensorParallelRanks(world_size=world_size, size=tensor_parallel)


def data_rank_sizes(samples: int, ranks: TensorParallelRanks) -> list[int]:
    """Each data-parallel rank's share of ``samples`` (as even as possible, in order)."""
    return split_sizes(samples, ranks.data_parallel)


def per_owner(values: Sequence[V], ranks: TensorParallelRanks) -> list[V]:
    """One entry per data-parallel rank, repeated for each of its T owners (rank order)."""
    if ranks.size == 1:  # every owner its own data-parallel rank (a rank check each cost 0.5 ms at 8,192)
        return list(values[:ranks.world_size])
    return [values[ranks.dp_rank(r)] for r in range(ranks.world_size)]


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """A global batch cut for ``world_size`` owners: the piece every request names (``piece``:
    the staged batch's key, or the dataset), a dataset's indices packed (``counts`` per owner in
    rank order, ``indices`` concatenated: no per-owner record, so a step down the relay tree
    costs the driver no work per owner), and the objects to stage under ``key`` first, one per
    owner (none for a dataset's pieces). The pool stages them (``OwnerPool.stage``); the caller
    holds this until the owners are done, so that the object store keeps the pieces that long."""

    key: str
    world_size: int
    piece: Piece
    counts: tuple[int, ...] = ()
    indices: tuple[int, ...] = ()
    objects: list[ray.ObjectRef] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.objects and len(self.objects) != self.world_size:
            raise ConfigError(f"{len(self.objects)} objects to stage for {self.world_size} owners under {self.key!r}: "
                              "a batch stages one object per owner, or none")
        if self.counts and len(self.counts) != self.world_size:
            raise ConfigError(f"{len(self.counts)} index counts for {self.world_size} owners: one each")

    @property
    def pieces(self) -> list[Piece]:
        """Each owner's own piece, in rank order (the direct path's requests)."""
        if not self.counts:
            return [self.piece] * self.world_size
        out, start = [], 0
        for n in self.counts:
            out.append(dataclasses.replace(self.piece, indices=self.indices[start:start + n]))
            start += n
        return out


@dataclass(frozen=True, kw_only=True)
class StepCommand:
    """One step as the owners are asked to run it: what every owner runs (``step``, its piece
    ``out.piece``) and the batch cut for them (``out``)."""

    step: StepArgs
    out: Outgoing

    def per_rank(self) -> list[StepArgs]:
        """Every owner's own request, in rank order (the direct path)."""
        return [dataclasses.replace(self.step, piece=p) for p in self.out.pieces]

    def relayed(self, *, timeout_s: float) -> RelayStepArgs:
        """The request to the relay tree's top, for every rank (``driver/relay_plane.py``)."""
        return RelayStepArgs.of(self.step, ranks=range(self.out.world_size), counts=self.out.counts,
                                indices=self.out.indices, timeout_s=timeout_s)


@dataclass(frozen=True, kw_only=True)
class EvaluateCommand:
    """One evaluation as the owners are asked to run it: what every owner runs (``evaluate``,
    its piece ``out.piece``) and the batch cut for them (``out``)."""

    evaluate: EvaluateArgs
    out: Outgoing

    def per_rank(self) -> list[EvaluateArgs]:
        """Every owner's own request, in rank order (the direct path)."""
        return [dataclasses.replace(self.evaluate, piece=p) for p in self.out.pieces]

    def relayed(self, *, timeout_s: float) -> RelayEvaluateArgs:
        """The request to the relay tree's top, for every rank (``driver/relay_plane.py``)."""
        return RelayEvaluateArgs.of(self.evaluate, ranks=range(self.out.world_size), counts=self.out.counts,
                                    indices=self.out.indices, timeout_s=timeout_s)


@dataclass(frozen=True)
class StagedBatch:
    """A global batch the driver holds."""

    batch: Batch

    @property
    def samples(self) -> int:
        return batch_size(self.batch)

    def split(self, *, world_size: int, key: str, tensor_parallel: int = 1) -> Outgoing:
        """Every data-parallel rank's piece put in the object store once, to be staged under
        ``key`` on each of its ``tensor_parallel`` owners."""
        ranks = rank_table(world_size, tensor_parallel)
        pieces = [ray.put(p) for p in split_batch(self.batch, data_rank_sizes(self.samples, ranks))]
        refs = per_owner(pieces, ranks)
        return Outgoing(key=key, world_size=world_size, piece=Piece(batch_key=key), objects=refs)


@dataclass(frozen=True)
class IndexedBatch:
    """A global batch of a dataset every owner holds: its indices, in order."""

    dataset: str
    indices: tuple[int, ...]

    @property
    def samples(self) -> int:
        return len(self.indices)

    def split(self, *, world_size: int, key: str, tensor_parallel: int = 1) -> Outgoing:
        """Every owner's indices, packed: its data-parallel rank's (the same for the
        ``tensor_parallel`` owners of one); nothing to stage (each owner holds the dataset)."""
        ranks = rank_table(world_size, tensor_parallel)
        sizes = data_rank_sizes(self.samples, ranks)
        counts = per_owner(sizes, ranks)
        indices = self.indices
        if tensor_parallel > 1:  # each data-parallel rank's run of indices, once per owner of it
            starts = [0]
            for n in sizes:
                starts.append(starts[-1] + n)
            indices = tuple(i for r in range(world_size) for i in self.indices[starts[ranks.dp_rank(r)]:
                                                                               starts[ranks.dp_rank(r) + 1]])
        return Outgoing(key=key, world_size=world_size, piece=Piece(dataset=self.dataset),
                        counts=tuple(counts), indices=tuple(indices))


GlobalBatch = StagedBatch | IndexedBatch


class Replay:
    """The global batches of the last ``keep`` steps, by step index: what a restore sends
    again (the controller keeps each step's batch here as it sends it; the recovery checks that
    they cover the steps to replay)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._batches: dict[int, GlobalBatch] = {}

    def add(self, index: int, work: GlobalBatch) -> None:
        self._batches[index] = work
        while len(self._batches) > self._keep:
            del self._batches[min(self._batches)]

    def __getitem__(self, index: int) -> GlobalBatch:
        return self._batches[index]

    def missing(self, start: int, end: int) -> list[int]:
        return [i for i in range(start, end) if i not in self._batches]

    def samples(self, start: int, end: int) -> int:
        return sum(self._batches[i].samples for i in range(start, end))
