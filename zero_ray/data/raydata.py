"""A ``ray.data.Dataset`` as a block source: one block per Ray Data block, kept in Ray's object store.

``fit`` executes the dataset once (``Dataset.iter_internal_ref_bundles``: Ray Data's own blocks,
made and held by Ray's workers across the cluster; the driver holds their references only) and
takes each block's rows and bytes from the metadata Ray Data reports with it: no task of ours
runs per block, and no worker process is started beyond what Ray Data's own execution takes
(its tasks ask for CPUs, so at most one per CPU). Owners fetch whole blocks by reference
(``ray.get`` on the owner; a block Ray Data holds in pandas is made a PyArrow table there) into
the same bounded cache and prefetch as files (``data/reader.py``), in the same ``BlockOrder``.
The blocks stay in the object store (spilled to disk by Ray when it fills) for as long as the
trainer holds the dataset: a replay, a resize or a recovery reads the same blocks.

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
from zero_ray.data.read_options import FromSource, check_read_options
from zero_ray.data.parquet import ParquetBlock, column_data
from zero_ray.errors import ConfigError, DataError


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
        """Execute the dataset into blocks in the object store; their rows and sizes, from Ray
        Data's metadata. Once per Dataset object: later fits (after a resize, say) read the same
        blocks."""
        try:
            executed = _EXECUTED.get(self.dataset)
        except TypeError:  # not weakly referenceable: executed again
            executed = None
        if executed is None:
            executed = execute(self.dataset)
            try:
                _EXECUTED[self.dataset] = executed
            except TypeError:
                pass
        return RayDatasetLayout(source=self, refs=executed.refs, block_sizes=executed.rows, group_bytes=executed.nbytes,
                                offsets=executed.offsets, columns=self._columns(executed.names),
                                cache_bytes=self.cache_bytes or 3 * self.window * max(executed.nbytes))

    def _columns(self, names: tuple[str, ...]) -> tuple[str, ...]:
        columns = tuple(self.columns) if self.columns is not None else names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"the Ray Dataset has no column {missing[0]!r} (its columns: {list(names)})")
        return columns


@dataclass(frozen=True, kw_only=True)
class Executed:
    """A Dataset's blocks in the object store (empty ones left out): the references, the rows
    each holds for the dataset, where those rows start in the block (Ray Data may hand out a
    slice of a block), the block's bytes, and the dataset's column names."""

    refs: tuple[Any, ...]
    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    names: tuple[str, ...]


def execute(dataset: Any) -> Executed:
    """Run ``dataset`` to the end and keep its blocks' references, rows and bytes as Ray Data
    reports them with each block (``RefBundle.blocks``: a reference and its ``BlockMetadata``;
    ``RefBundle.slices``: the part of each block that belongs to the dataset). Nothing is
    fetched and no task is started here beyond Ray Data's own execution."""
    import ray.data

    refs: list[Any] = []
    rows: list[int] = []
    offsets: list[int] = []
    nbytes: list[int] = []
    schema = None
    for bundle in dataset.iter_internal_ref_bundles():
        for entry, cut in zip(bundle.blocks, bundle.slices, strict=True):
            meta = entry.metadata
            if cut is not None:
                n, start = cut.end_offset - cut.start_offset, cut.start_offset
            elif meta.num_rows is not None:
                n, start = meta.num_rows, 0
            else:
                raise DataError(f"Ray Data reported no row count for block {len(refs)} of {dataset} (its metadata: "
                                f"{meta}); map it once (ds.map_batches(lambda b: b)) so that Ray Data measures each "
                                "block it makes")
            if n:
                refs.append(entry.ref)
                rows.append(n)
                offsets.append(start)
                nbytes.append(max(1, int(meta.size_bytes)))
                if schema is None and bundle.schema is not None:
                    schema = bundle.schema
    if not refs:
        raise DataError(f"the Ray Dataset {dataset} holds no rows")
    names = tuple(ray.data.Schema(schema).names) if schema is not None else ()
    return Executed(refs=tuple(refs), rows=tuple(rows), offsets=tuple(offsets), nbytes=tuple(nbytes), names=names)


# Each Dataset object's blocks, held while the user holds the Dataset.
_EXECUTED: weakref.WeakKeyDictionary[Any, Executed] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class RayDatasetLayout(FromSource):
    """A Ray Dataset executed into blocks: what the owners read by (the blocks' references)."""

    source: RayDataset
    refs: tuple[Any, ...]
    block_sizes: tuple[int, ...]
    group_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    columns: tuple[str, ...]
    cache_bytes: int
    files: tuple[DataFile, ...] = ()

    def __reduce__(self) -> Any:  # owners get the references, not the driver's Dataset object
        return (_rebuild, (self.refs, self.block_sizes, self.group_bytes, self.offsets, self.columns, self.cache_bytes,
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

    def read_block(self, block: int, files: FileReader | None) -> ParquetBlock:
        """Fetch block ``block`` by reference, as a PyArrow table of the dataset's rows of it."""
        try:
            table = as_arrow(ray.get(self.refs[block]))
        except ray.exceptions.RayError as err:
            raise DataError(f"block {block} of the {self.what} could not be fetched: {err}") from err
        start, n = self.offsets[block], self.block_sizes[block]
        if table.num_rows < start + n:
            raise DataError(f"block {block} of the {self.what} holds {table.num_rows} rows; Ray Data reported rows "
                            f"{start}..{start + n} of it")
        if (start, n) != (0, table.num_rows):
            table = table.slice(start, n)  # zero-copy
        return ParquetBlock(columns={c: column_data(table.column(c)) for c in self.columns})


def as_arrow(block: Any) -> Any:
    """A Ray Data block as a PyArrow table: itself, or (a pandas block) converted here, on the
    owner that read it, rather than in a Ray task per block on the driver's behalf."""
    import pyarrow as pa

    if isinstance(block, pa.Table):
        return block
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_arrow()


def _rebuild(refs: tuple[Any, ...], sizes: tuple[int, ...], nbytes: tuple[int, ...], offsets: tuple[int, ...],
             columns: tuple[str, ...], cache_bytes: int, window: int, prefetch_steps: int) -> RayDatasetLayout:
    source = RayDataset(None, columns=columns, window=window, cache_bytes=cache_bytes, prefetch_steps=prefetch_steps)
    return RayDatasetLayout(source=source, refs=refs, block_sizes=sizes, group_bytes=nbytes, offsets=offsets,
                            columns=columns, cache_bytes=cache_bytes)
