"""Training data at corpus scale: sources each owner reads itself, from local disk or an object
store, in an order that is a function of (seed, epoch, step) alone (docs/data.md).

- ``TokenFiles(urls, seq_len=..., dtype=...)``: flat token files (nanoGPT ``.bin``).
- ``Parquet(urls, columns=...)``: a sample per row.
- a ``ray.data.Dataset`` (``RayDataset``): a sample per row, its blocks in Ray's object store.

Pass one to ``ZeroTrainer.fit``: the driver reads metadata only (file sizes, Parquet footers),
every owner opens the source itself and reads whole blocks of what its pieces need, with a
bounded cache and background prefetch (``data/reader.py``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from zero_ray.core.data_order import BlockOrder
from zero_ray.data.parquet import Parquet, ParquetLayout
from zero_ray.data.raydata import RayDataset, RayDatasetLayout
from zero_ray.data.reader import BlockReader
from zero_ray.data.tokens import TokenFiles, TokenLayout

DataSource = TokenFiles | Parquet | RayDataset
SourceLayout = TokenLayout | ParquetLayout | RayDatasetLayout

__all__ = ["BlockReader", "DataSource", "Parquet", "RayDataset", "SourceLayout", "TokenFiles", "as_source", "opener"]


def as_source(dataset: Any) -> DataSource | None:
    """``dataset`` as a block source: itself, a ``ray.data.Dataset`` wrapped in ``RayDataset``,
    or None (a map-style dataset or a factory)."""
    if isinstance(dataset, DataSource):
        return dataset
    ray_data = sys.modules.get("ray.data")  # a Ray Dataset was made with it, so it is imported
    if ray_data is not None and isinstance(dataset, ray_data.Dataset):
        return RayDataset(dataset)
    return None


def opener(layout: SourceLayout, order: BlockOrder | None = None) -> Callable[[], Any]:
    """What an owner calls to open ``layout`` (a small picklable partial: the layout is file
    names and sizes); ``order``: the training order, for prefetch (None: evaluation, read in
    index order)."""
    return functools.partial(BlockReader, layout, order=order)
