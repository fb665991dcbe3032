"""The order ``ZeroTrainer.fit`` reads a dataset in: fixed, documented, and a function of the
step number alone, so a replayed, resized or resumed run reads exactly the same samples.

Epoch ``e`` is ``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``;
global batch ``k`` of the run is the ``(k mod B)``-th consecutive slice of ``global_batch_size``
indices of epoch ``k div B``, where ``B = len(dataset) // global_batch_size`` (a partial last
batch is dropped); ranks split it as ``step()`` splits a batch (``core.batching.split_sizes``).
Evaluation reads a dataset in index order, in chunks of ``global_batch_size``.

Data read in blocks (``zero_ray.data``: byte ranges of token files, Parquet row groups) is read
in ``BlockOrder``: a sample-level permutation would turn every batch into one small read per
sample, which an object store cannot serve. The blocks of an epoch are permuted, and the samples
of each window of consecutive permuted blocks are shuffled among themselves (see ``BlockOrder``);
global batches are again consecutive slices of the epoch's sequence. It is still a function of
(seed, epoch, step) alone and does not depend on the world size.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
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


def window_seed(seed: int, epoch: int, window: int) -> int:
    """The seed of the shuffle inside window ``window`` of epoch ``epoch``: the first 8 bytes
    (little-endian, top bit cleared) of BLAKE2b-64 of ``"{seed}:{epoch}:{window}"``."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{window}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True, kw_only=True)
class BlockOrder:
    """Which samples global batch ``k`` holds, for data read in blocks.

    ``block_sizes[b]`` is how many samples block ``b`` holds; block ``b`` holds the indices
    ``offset[b] .. offset[b] + block_sizes[b] - 1`` (offsets are the running sums). Epoch ``e``:

    1. the blocks are permuted: ``torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed + e))``;
    2. the permuted blocks are cut into windows of ``window`` consecutive blocks (the last may
       be shorter); window ``w``'s samples are its blocks' indices, block after block in permuted
       order, reordered by ``torch.randperm(n, generator=...manual_seed(window_seed(seed, e, w)))``;
    3. the epoch is the windows' samples in window order; global batch ``k`` is the
       ``(k mod B)``-th consecutive slice of ``global_batch_size`` of epoch ``k div B``, with
       ``B = length // global_batch_size`` (a partial last batch is dropped).

    An owner therefore reads each block once per epoch (one ranged read, or one row group), and
    holds about one window at a time; the window bounds how far apart in the data two samples of
    one batch can come from.
    """

    block_sizes: tuple[int, ...]
    global_batch_size: int
    seed: int = 0
    window: int = 4

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if not self.block_sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                       for n in self.block_sizes):
            raise ConfigError(f"block_sizes must be a non-empty tuple of sample counts >= 0 "
                              f"(got {self.block_sizes[:8]!r}...)")
        if self.global_batch_size > self.length:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is larger than the data "
                              f"({self.length} samples); lower it or use more data")

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """``offsets[b]``: the first index of block ``b``; the last entry is ``length``."""
        return tuple(itertools.accumulate(self.block_sizes, initial=0))

    @property
    def length(self) -> int:
        return sum(self.block_sizes)

    @property
    def batches_per_epoch(self) -> int:
        return self.length // self.global_batch_size

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global batch ``step`` (0-based)."""
        return divmod(step, self.batches_per_epoch)

    def block_of(self, index: int) -> int:
        """The block holding sample ``index``."""
        return bisect.bisect_right(self.offsets, index) - 1

    def indices(self, step: int) -> tuple[int, ...]:
        epoch, k = self.position(step)
        start = k * self.global_batch_size
        end = start + self.global_batch_size
        _, bounds = _epoch_windows(self, epoch)
        out: list[int] = []
        w = bisect.bisect_right(bounds, start) - 1
        while start < end:
            samples = _window_samples(self, epoch, w)
            lo, hi = start - bounds[w], min(end, bounds[w + 1]) - bounds[w]
            out += samples[lo:hi].tolist()
            start += hi - lo
            w += 1
        return tuple(out)


@functools.lru_cache(maxsize=4)  # the current epoch and the next, for a couple of orders
def _epoch_windows(order: BlockOrder, epoch: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Epoch ``epoch``'s block permutation and where each window starts in it (in samples; the
    last entry is the epoch's length)."""
    perm = torch.randperm(len(order.block_sizes), generator=torch.Generator().manual_seed(order.seed + epoch))
    sizes = [order.block_sizes[b] for b in perm.tolist()]
    bounds = [0]
    for w in range(0, len(sizes), order.window):
        bounds.append(bounds[-1] + sum(sizes[w:w + order.window]))
    return perm, tuple(bounds)


@functools.lru_cache(maxsize=8)  # a batch spans at most a few windows
def _window_samples(order: BlockOrder, epoch: int, w: int) -> torch.Tensor:
    perm, _ = _epoch_windows(order, epoch)
    blocks = perm[w * order.window:(w + 1) * order.window].tolist()
    samples = torch.cat([torch.arange(order.offsets[b], order.offsets[b + 1]) for b in blocks])
    shuffle = torch.randperm(len(samples), generator=torch.Generator().manual_seed(window_seed(order.seed, epoch, w)))
    return samples[shuffle]


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
