"""Training data at corpus scale: sources each owner reads itself, from local disk or an object
store, in an order that is a function of (seed, epoch, step) alone (docs/data.md).

- ``TokenFiles(urls, seq_len=..., dtype=...)``: flat token files (nanoGPT ``.bin``).
- ``Parquet(urls, columns=...)``: a sample per row.

Pass one to ``ZeroTrainer.fit``: the driver reads metadata only (file sizes, Parquet footers),
every owner opens the source itself and reads whole blocks of what its pieces need, with a
bounded cache and background prefetch (``data/reader.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zero_ray.core.epochs import BlockOrder
from zero_ray.data.parquet import Parquet, ParquetLayout
from zero_ray.data.reader import BlockReader
from zero_ray.data.tokens import TokenFiles, TokenLayout

DataSource = TokenFiles | Parquet
SourceLayout = TokenLayout | ParquetLayout

__all__ = ["BlockReader", "DataSource", "Parquet", "SourceLayout", "TokenFiles", "opener"]


def opener(layout: SourceLayout, order: BlockOrder | None = None) -> Callable[[], Any]:
    """What an owner calls to open ``layout`` (a small picklable partial: the layout is file
    names and sizes); ``order``: the training order, for prefetch (None: evaluation, read in
    index order)."""
    return functools.partial(BlockReader, layout, order=order)
