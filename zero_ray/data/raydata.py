"""A ``ray.data.Dataset`` as a block source: one block per Ray Data block, kept in Ray's object store.

``fit`` executes the dataset once (``Dataset.to_arrow_refs``: one PyArrow table per block, made
and held by Ray's workers across the cluster; the driver holds their references only) and
counts each block's rows with a small Ray task beside it. Owners fetch whole blocks by reference
(``ray.get`` on the owner) into the same bounded cache and prefetch as files
(``data/reader.py``), in the same ``BlockOrder``. The blocks stay in the object store (spilled
to disk by Ray when it fills) for as long as the trainer holds the dataset: a replay, a resize or
a recovery reads the same blocks.

``fit`` executes a Dataset object once: later fits over it (after a resize, say) read the same
blocks, which stay in the object store while the Dataset object lives. The order is then
exact within a run. A run resumed by a new driver executes the dataset again:
its order is the same only if the dataset is deterministic (the same source, seeded shuffles)
and Ray Data keeps block order (``DataContext.get_current().execution_options.preserve_order =
True``); the checkpoint records the rows of every block, and a resume that sees other blocks is
refused, naming what changed.
"""

from __future__ import annotations

import weakref
from dataclasses import KW_ONLY, dataclass
from typing import Any

import ray

from zero_ray.data.files import DataFile, FileReader
from zero_ray.data.options import FromSource, check_read_options
from zero_ray.data.parquet import ParquetBlock, column_data
from zero_ray.errors import ConfigError, DataError


@ray.remote(num_cpus=0)
def _block_rows(table: Any) -> tuple[int, int]:
    """A block's rows and bytes (runs where Ray places it: the block never reaches the driver)."""
    return table.num_rows, table.nbytes


@dataclass(frozen=True)
class RayDataset:
    """A ``ray.data.Dataset`` read by blocks (``fit`` wraps one passed to it in this).

    columns: the columns a sample holds (default: all). window / cache_bytes / prefetch_steps
    as for ``Parquet``.
    """

    dataset: Any
    _: KW_ONLY
    columns: tuple[str, ...] | None = None
    window: int = 4
    cache_bytes: int | None = None
    prefetch_steps: int = 2

    def __post_init__(self) -> None:
        check_read_options(self)

    def scan(self) -> RayDatasetLayout:
        """Execute the dataset into blocks in the object store; their rows and sizes. Once per
        Dataset object: later fits (after a resize, say) read the same blocks."""
        try:
            executed = _EXECUTED.get(self.dataset)
        except TypeError:  # not weakly referenceable: executed again
            executed = None
        if executed is None:
            executed = self._execute()
            try:
                _EXECUTED[self.dataset] = executed
            except TypeError:
                pass
        return RayDatasetLayout(source=self, refs=executed.refs, block_sizes=executed.rows, group_bytes=executed.nbytes,
                                columns=self._columns(),
                                cache_bytes=self.cache_bytes or 3 * self.window * max(executed.nbytes))

    def _columns(self) -> tuple[str, ...]:
        schema = self.dataset.schema()
        names = tuple(schema.names) if schema is not None else ()
        columns = tuple(self.columns) if self.columns is not None else names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"the Ray Dataset has no column {missing[0]!r} (its columns: {list(names)})")
        return columns

    def _execute(self) -> Executed:
        refs = list(self.dataset.to_arrow_refs())
        counted = ray.get([_block_rows.remote(r) for r in refs])
        keep = [(ref, rows, size) for ref, (rows, size) in zip(refs, counted) if rows]
        if not keep:
            raise DataError(f"the Ray Dataset {self.dataset} holds no rows")
        return Executed(refs=tuple(r for r, _, _ in keep), rows=tuple(n for _, n, _ in keep),
                        nbytes=tuple(b for _, _, b in keep))


@dataclass(frozen=True, kw_only=True)
class Executed:
    """A Dataset's blocks in the object store: references, rows and bytes of each (empty ones left out)."""

    refs: tuple[Any, ...]
    rows: tuple[int, ...]
    nbytes: tuple[int, ...]


# Each Dataset object's blocks, held while the user holds the Dataset.
_EXECUTED: weakref.WeakKeyDictionary[Any, Executed] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class RayDatasetLayout(FromSource):
    """A Ray Dataset executed into blocks: what the owners read by (the blocks' references)."""

    source: RayDataset
    refs: tuple[Any, ...]
    block_sizes: tuple[int, ...]
    group_bytes: tuple[int, ...]
    columns: tuple[str, ...]
    cache_bytes: int
    files: tuple[DataFile, ...] = ()

    def __reduce__(self) -> Any:  # owners get the references, not the driver's Dataset object
        return (_rebuild, (self.refs, self.block_sizes, self.group_bytes, self.columns, self.cache_bytes,
                           self.source.window, self.source.prefetch_steps))

    @property
    def what(self) -> str:
        return f"Ray Dataset of {len(self.refs)} blocks"

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data: resuming over anything else is refused."""
        return {"kind": "RayDataset", "columns": list(self.columns), "rows": list(self.block_sizes),
                "window": self.source.window}

    def block_bytes(self, block: int) -> int:
        return self.group_bytes[block]

    def read_block(self, block: int, files: FileReader) -> ParquetBlock:
        try:
            table = ray.get(self.refs[block])
        except ray.exceptions.RayError as err:
            raise DataError(f"block {block} of the {self.what} could not be fetched: {err}") from err
        return ParquetBlock(columns={c: column_data(table.column(c)) for c in self.columns})


def _rebuild(refs: tuple[Any, ...], sizes: tuple[int, ...], nbytes: tuple[int, ...], columns: tuple[str, ...],
             cache_bytes: int, window: int, prefetch_steps: int) -> RayDatasetLayout:
    source = RayDataset(None, columns=columns, window=window, cache_bytes=cache_bytes, prefetch_steps=prefetch_steps)
    return RayDatasetLayout(source=source, refs=refs, block_sizes=sizes, group_bytes=nbytes, columns=columns,
                            cache_bytes=cache_bytes)
