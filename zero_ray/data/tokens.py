"""``TokenFiles``: flat little-endian token files, the nanoGPT ``.bin`` layout (what
``numpy.memmap`` or ``array.tofile`` writes), read as fixed windows of tokens.

The files are one token stream, concatenated in order. Sample ``i`` is the ``seq_len + 1``
tokens starting at token ``i * seq_len`` (inputs and their next-token targets: consecutive
samples share one token), so there are ``(tokens - 1) // seq_len`` samples. Block ``b`` (one
ranged read) holds samples ``b * S .. (b + 1) * S - 1`` with ``S = max(1, block_tokens // seq_len)``;
the last block may be shorter.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import torch

from zero_ray.data.files import DataFile, FileReader, resolve
from zero_ray.data.read_options import FromSource, check_read_options
from zero_ray.errors import ConfigError, DataError

DTYPES = {"uint16": "<u2", "uint32": "<u4"}


@dataclass(frozen=True)
class TokenFiles:
    """Token files at ``urls`` (a path, URL or glob, or a list of them; see ``zero_ray.data``).

    seq_len: tokens a sample predicts (a sample holds ``seq_len + 1``).
    dtype: ``"uint16"`` (vocabularies up to 65,536) or ``"uint32"``, little-endian.
    block_tokens: tokens per block: one ranged read, and the unit ``BlockOrder`` permutes.
    window: blocks whose samples are shuffled together (``core/data_order.BlockOrder``).
    cache_bytes: an owner's block cache (default: three windows of blocks).
    prefetch_steps: global batches whose blocks are read ahead in the background.
    filesystem: a ``pyarrow.fs`` or fsspec filesystem the paths are in (shipped to the owners).
    """

    urls: str | Sequence[str]
    _: KW_ONLY
    seq_len: int
    dtype: str = "uint16"
    block_tokens: int = 1 << 18
    window: int = 16
    cache_bytes: int | None = None
    prefetch_steps: int = 2
    filesystem: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"TokenFiles(dtype={self.dtype!r}) must be one of {sorted(DTYPES)}")
        check_read_options(self, seq_len=self.seq_len, block_tokens=self.block_tokens)

    def scan(self) -> TokenLayout:
        """The files' sizes (metadata only: no token is read) and the blocks they make."""
        what = f"TokenFiles({self.urls!r})"
        files = resolve(self.urls, filesystem=self.filesystem, what=what)
        itemsize = np.dtype(DTYPES[self.dtype]).itemsize
        for f in files:
            if f.size % itemsize:
                raise DataError(f"{f.url}: {f.size} bytes is not a whole number of {self.dtype} tokens "
                                f"({itemsize} bytes each): the file is truncated or not a {self.dtype} token file")
        tokens = sum(f.size for f in files) // itemsize
        samples = (tokens - 1) // self.seq_len if tokens else 0
        if samples < 1:
            raise DataError(f"{what}: seq_len={self.seq_len} needs at least {self.seq_len + 1} tokens but the files "
                            f"hold {tokens}; lower seq_len or add data")
        per_block = max(1, self.block_tokens // self.seq_len)
        sizes = (per_block,) * (samples // per_block) + ((samples % per_block,) if samples % per_block else ())
        block = per_block * self.seq_len * itemsize
        return TokenLayout(source=self, files=files, block_sizes=sizes, itemsize=itemsize,
                           cache_bytes=self.cache_bytes or 3 * self.window * block)


@dataclass(frozen=True, kw_only=True)
class TokenLayout(FromSource):
    """``TokenFiles`` scanned: what the owners read by."""

    source: TokenFiles
    files: tuple[DataFile, ...]
    block_sizes: tuple[int, ...]
    itemsize: int
    cache_bytes: int

    @property
    def what(self) -> str:
        return f"TokenFiles({self.source.urls!r})"

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data: resuming over anything else is refused."""
        s = self.source
        return {"kind": "TokenFiles", "files": [[f.url, f.size] for f in self.files], "seq_len": s.seq_len,
                "dtype": s.dtype, "block_tokens": s.block_tokens, "window": s.window}

    @functools.cached_property
    def _file_ends(self) -> list[int]:
        """Where each file's tokens end in the concatenated stream (computed once, not per block)."""
        return list(itertools.accumulate(f.size // self.itemsize for f in self.files))

    def _per_block(self) -> int:
        return self.block_sizes[0]

    def block_bytes(self, block: int) -> int:
        return (self.block_sizes[block] * self.source.seq_len + 1) * self.itemsize

    def read_block(self, block: int, files: FileReader) -> TokenBlock:
        seq = self.source.seq_len
        first = block * self._per_block()
        start, stop = first * seq, (first + self.block_sizes[block]) * seq + 1  # in tokens
        data = b"".join(self._read_tokens(start, stop, files))
        tokens = np.frombuffer(data, dtype=DTYPES[self.source.dtype])
        return TokenBlock(tokens=tokens, seq_len=seq)

    def _read_tokens(self, start: int, stop: int, files: FileReader) -> list[bytes]:
        """Tokens ``[start, stop)`` of the concatenated stream, file by file."""
        ends = self._file_ends
        parts = []
        i = bisect.bisect_right(ends, start)
        while start < stop:
            begin = ends[i - 1] if i else 0
            take = min(stop, ends[i]) - start
            if take > 0:
                parts.append(files.read(i, (start - begin) * self.itemsize, take * self.itemsize))
                start += take
            i += 1
        return parts


@dataclass(frozen=True, kw_only=True)
class TokenBlock:
    tokens: np.ndarray
    seq_len: int

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes)

    def sample(self, i: int) -> torch.Tensor:
        """``seq_len + 1`` tokens as int64 (what embedding layers and cross-entropy take)."""
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
