"""How a global batch reaches the owners: the pieces a Step or Evaluate request names.

``StagedBatch`` (``step(batch)``, ``evaluate(batch)``): the driver holds the batch, splits it
along dim 0 and puts each owner's piece in Ray's object store; the reference goes to its owner
in a Ray call, which Ray resolves and reference-counts, and the request names it by key. The
driver drops its references once the step is over and the object is freed: no out-of-band
ObjectRef, so nothing is pinned.

``IndexedBatch`` (``fit``): each owner holds the dataset; the request carries that owner's
indices and the owner builds its piece. The driver keeps no batches, only indices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import ray

from zero_ray.control.handlers import EvaluateArgs, Piece, RelayEvaluateArgs, RelayStepArgs, StepArgs
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.errors import ConfigError


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

    def split(self, *, world_size: int, key: str) -> Outgoing:
        """Every owner's piece put in the object store, to be staged under ``key``."""
        refs = [ray.put(p) for p in split_batch(self.batch, split_sizes(self.samples, world_size))]
        return Outgoing(key=key, world_size=world_size, piece=Piece(batch_key=key), objects=refs)


@dataclass(frozen=True)
class IndexedBatch:
    """A global batch of a dataset every owner holds: its indices, in order."""

    dataset: str
    indices: tuple[int, ...]

    @property
    def samples(self) -> int:
        return len(self.indices)

    def split(self, *, world_size: int, key: str) -> Outgoing:
        """Every owner's indices, packed; nothing to stage (each owner holds the dataset)."""
        return Outgoing(key=key, world_size=world_size, piece=Piece(dataset=self.dataset),
                        counts=tuple(split_sizes(self.samples, world_size)), indices=self.indices)


GlobalBatch = StagedBatch | IndexedBatch
