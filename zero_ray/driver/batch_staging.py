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
from typing import Any, Protocol

import ray

from zero_ray.control.handlers import Piece
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes


class Stager(Protocol):
    """What sending pieces needs of the pool."""

    def stage(self, key: str, pieces: list[ray.ObjectRef]) -> list[ray.ObjectRef]: ...


@dataclass(frozen=True)
class StagedBatch:
    """A global batch the driver holds."""

    batch: Batch

    @property
    def samples(self) -> int:
        return batch_size(self.batch)

    def send(self, pool: Stager, *, world_size: int, key: str) -> tuple[list[Piece], Any]:
        """Stage every owner's piece under ``key``; the pieces to name, and what to hold until
        the owners are done (the object references and the staging calls)."""
        refs = [ray.put(p) for p in split_batch(self.batch, split_sizes(self.samples, world_size))]
        calls = pool.stage(key, refs)
        return [Piece(batch_key=key)] * world_size, (refs, calls)


@dataclass(frozen=True)
class IndexedBatch:
    """A global batch of a dataset every owner holds: its indices, in order."""

    dataset: str
    indices: tuple[int, ...]

    @property
    def samples(self) -> int:
        return len(self.indices)

    def send(self, pool: Stager, *, world_size: int, key: str) -> tuple[list[Piece], Any]:
        pieces, start = [], 0
        for n in split_sizes(self.samples, world_size):
            pieces.append(Piece(dataset=self.dataset, indices=self.indices[start:start + n]))
            start += n
        return pieces, None


GlobalBatch = StagedBatch | IndexedBatch
