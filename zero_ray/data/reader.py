"""An owner's reader of a block source: the map-style dataset ``fit`` hands samples from.

Samples live in blocks (``Layout``: a token file's byte range, a Parquet row group). The reader
keeps the blocks it read in a cache bounded by ``cache_bytes`` (least recently used first out,
never a block the current step or the prefetched ones need), and after each step it starts
reading, on background threads, the blocks the next ``prefetch_steps`` global batches hold
(``core/data_order.BlockOrder`` gives them from the step number alone), as far as the cache has room.
So a step reads from memory once the first one has, and an owner's memory holds the cache plus
the step's own samples, whatever the size of the data.

A block read that fails in the background is read again when a step needs it; a read that
still fails raises ``DataError`` (``data/files.py``), which fails the step.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from zero_ray.core.data_order import BlockOrder
from zero_ray.data.files import DataFile, FileReader

log = logging.getLogger(__name__)


class Block(Protocol):
    """One block read into memory."""

    nbytes: int

    def sample(self, i: int) -> Any:
        """The ``i``-th sample of the block."""


class Layout(Protocol):
    """A source as the driver scanned it: its files and blocks, and how an owner reads a block."""

    files: tuple[DataFile, ...]
    block_sizes: tuple[int, ...]  # samples per block, in index order
    filesystem: Any
    cache_bytes: int
    prefetch_steps: int

    @property
    def what(self) -> str:
        """The source in words, for errors."""

    def block_bytes(self, block: int) -> int:
        """About how many bytes block ``block`` takes in memory (the prefetch's budget)."""

    def read_block(self, block: int, files: FileReader) -> Block:
        """Read block ``block``."""


class BlockReader:
    """``len`` and ``[i]`` over a layout's samples, with ``read(indices, step=)`` for a step's
    piece (counting how long it waited) and prefetch of the next steps' blocks."""

    def __init__(self, layout: Layout, *, order: BlockOrder | None = None) -> None:
        self._layout = layout
        self._order = order
        self._offsets = list(itertools.accumulate(layout.block_sizes, initial=0))
        self._files = FileReader(layout.files, filesystem=layout.filesystem, what=layout.what)
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Block] = OrderedDict()
        self._cached_bytes = 0
        self._loading: dict[int, Future[Block]] = {}
        self._needed: frozenset[int] = frozenset()  # blocks of the step in hand and of those prefetched
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zero_ray-data")
        self.blocks_read = 0  # reads from storage, foreground and background
        self.wait_seconds = 0.0  # how long the last read() waited for blocks
        self.missed_blocks = 0  # blocks the last read() found not yet in memory (read, or in flight)

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index: int) -> Any:
        return self.read([index])[0]

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def block_of(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside {self._layout.what} ({len(self)} samples)")
        return bisect.bisect_right(self._offsets, index) - 1

    def read(self, indices: Sequence[int], *, step: int | None = None) -> list[Any]:
        """The samples at ``indices``. ``step``: the global batch they belong to; the blocks of
        the ``prefetch_steps`` batches after it are then read in the background."""
        where = [self.block_of(i) for i in indices]
        blocks = sorted(set(where))
        upcoming = self._upcoming(step)
        start = time.perf_counter()
        with self._lock:
            self._needed = frozenset(blocks) | frozenset(upcoming)
            self.missed_blocks = sum(b not in self._cache for b in blocks)
        got = {b: self._get(b) for b in blocks}
        self.wait_seconds = time.perf_counter() - start
        self._prefetch(upcoming)
        return [got[b].sample(i - self._offsets[b]) for b, i in zip(where, indices)]

    def _upcoming(self, step: int | None) -> list[int]:
        """The blocks of the next ``prefetch_steps`` global batches after ``step``, in the order
        they will be needed."""
        if self._order is None or step is None:
            return []
        out: dict[int, None] = {}
        for s in range(step + 1, step + 1 + self._layout.prefetch_steps):
            for i in self._order.indices(s):
                out.setdefault(self.block_of(i))
        return list(out)

    def _get(self, block: int) -> Block:
        with self._lock:
            if block in self._cache:
                self._cache.move_to_end(block)
                return self._cache[block]
            pending = self._loading.get(block)
        if pending is not None:
            try:
                return pending.result()
            except Exception as err:  # noqa: BLE001 - read again below, in this thread, and raise if it persists
                log.warning("the background read of block %d of %s failed (%s); reading it again",
                            block, self._layout.what, err)
        return self._load(block)

    def _load(self, block: int) -> Block:
        data = self._layout.read_block(block, self._files)
        with self._lock:
            self.blocks_read += 1
            if block not in self._cache:
                self._cache[block] = data
                self._cached_bytes += data.nbytes
            self._evict()
        return data

    def _evict(self) -> None:
        """Drop least recently used blocks, never a needed one, until the cache fits (lock held)."""
        for block in list(self._cache):
            if self._cached_bytes <= self._layout.cache_bytes:
                return
            if block not in self._needed:
                self._cached_bytes -= self._cache.pop(block).nbytes

    def _prefetch(self, upcoming: list[int]) -> None:
        with self._lock:
            room = self._layout.cache_bytes - sum(self._cache[b].nbytes for b in self._needed if b in self._cache)
            room -= sum(self._layout.block_bytes(b) for b in self._loading)
            for block in upcoming:
                if block in self._cache or block in self._loading:
                    continue
                room -= self._layout.block_bytes(block)
                if room < 0:
                    return
                self._loading[block] = self._pool.submit(self._background, block)

    def _background(self, block: int) -> Block:
        try:
            return self._load(block)
        finally:
            with self._lock:
                self._loading.pop(block, None)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the background reads in flight; whether none is left."""
        with self._lock:
            pending = list(self._loading.values())
        done, left = wait(pending, timeout=timeout_s)
        return not left

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
