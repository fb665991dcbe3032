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

from dataclasses import dataclass

import ray

from zero_ray.control.handlers import Piece
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """A global batch cut for the owners: each owner's ``Piece`` (what its request names), and
    the objects to stage under ``key`` first, one per owner (none for a dataset's pieces). The
    pool stages them (``OwnerPool.stage``); the caller holds this until the owners are done, so
    that the object store keeps the pieces that long."""

    key: str
    pieces: list[Piece]
    objects: list[ray.ObjectRef]

    def __post_init__(self) -> None:
        if self.objects and len(self.objects) != len(self.pieces):
            raise ConfigError(f"{len(self.objects)} objects to stage for {len(self.pieces)} pieces under {self.key!r}: "
                              "a batch stages one object per owner, or none")


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
        return Outgoing(key=key, pieces=[Piece(batch_key=key)] * world_size, objects=refs)


@dataclass(frozen=True)
class IndexedBatch:
    """A global batch of a dataset every owner holds: its indices, in order."""

    dataset: str
    indices: tuple[int, ...]

    @property
    def samples(self) -> int:
        return len(self.indices)

    def split(self, *, world_size: int, key: str) -> Outgoing:
        """Every owner's indices; nothing to stage (each owner holds the dataset)."""
        pieces, start = [], 0
        for n in split_sizes(self.samples, world_size):
            pieces.append(Piece(dataset=self.dataset, indices=self.indices[start:start + n]))
            start += n
        return Outgoing(key=key, pieces=pieces, objects=[])


GlobalBatch = StagedBatch | IndexedBatch
