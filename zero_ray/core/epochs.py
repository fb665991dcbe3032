"""The order ``ZeroTrainer.fit`` reads a dataset in: fixed, documented, and a function of the
step number alone, so a replayed, resized or resumed run reads exactly the same samples.

Epoch ``e`` is ``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``;
global batch ``k`` of the run is the ``(k mod B)``-th consecutive slice of ``global_batch_size``
indices of epoch ``k div B``, where ``B = len(dataset) // global_batch_size`` (a partial last
batch is dropped); ranks split it as ``step()`` splits a batch (``core.batching.split_sizes``).
Evaluation reads a dataset in index order, in chunks of ``global_batch_size``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zero_ray.errors import ConfigError


@functools.lru_cache(maxsize=2)  # the current epoch, and the next one across a boundary
def _permutation(length: int, seed: int) -> torch.Tensor:
    # int32 where it fits: 4 bytes a sample, and the same permutation as torch's default int64
    # (randperm draws the same numbers whatever the index type; tests/unit/test_epochs.py checks).
    dtype = torch.int32 if length < 2**31 else torch.int64
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class EpochOrder:
    """Which samples global batch ``k`` holds."""

    length: int
    global_batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("length", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if self.global_batch_size > self.length:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is larger than the dataset "
                              f"({self.length} samples); lower it or use a larger dataset")

    @property
    def batches_per_epoch(self) -> int:
        return self.length // self.global_batch_size

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global batch ``step`` (0-based)."""
        return divmod(step, self.batches_per_epoch)

    def indices(self, step: int) -> tuple[int, ...]:
        epoch, k = self.position(step)
        start = k * self.global_batch_size
        return tuple(_permutation(self.length, self.seed + epoch)[start:start + self.global_batch_size].tolist())


def evaluation_chunks(length: int, global_batch_size: int, world_size: int) -> Iterator[tuple[int, ...]]:
    """Every index of a dataset of ``length`` samples once, in order, in chunks of
    ``global_batch_size``; a last chunk too small to give every rank a sample joins the one
    before it."""
    if length < world_size:
        raise ConfigError(f"the evaluation dataset has {length} samples, fewer than the {world_size} owners; "
                          "every owner needs at least one")
    starts = list(range(0, length, global_batch_size))
    if len(starts) > 1 and length - starts[-1] < world_size:
        starts.pop()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else length
        yield tuple(range(start, end))
