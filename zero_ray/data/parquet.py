"""``Parquet``: one sample per row of Parquet files, a block per row group.

The driver reads each file's footer (schema, row groups, their row counts and sizes) and
nothing else; an owner reads whole row groups of the columns asked for. A sample is a dict of
column -> value: numbers as 0-d tensors, lists of numbers as 1-D tensors, anything else as the
Python value (``torch.utils.data.default_collate`` stacks the tensors; ragged lists need a
``collate_fn`` of your own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import torch

from zero_ray.data.files import DataFile, FileReader, resolve
from zero_ray.data.read_options import FromSource, check_read_options
from zero_ray.errors import ConfigError, DataError


@dataclass(frozen=True)
class Parquet:
    """Parquet files at ``urls`` (a path, URL or glob, or a list of them; see ``zero_ray.data``).

    columns: the columns a sample holds (default: every column of the first file). Every file
        must have them, with the same types.
    window: row groups whose rows are shuffled together (``core/data_order.BlockOrder``).
    cache_bytes: an owner's row-group cache (default: three windows of the largest row group).
    prefetch_steps: global batches whose row groups are read ahead in the background.
    filesystem: a ``pyarrow.fs`` or fsspec filesystem the paths are in (shipped to the owners).
    """

    urls: str | Sequence[str]
    _: KW_ONLY
    columns: Sequence[str] | None = None
    window: int = 4
    cache_bytes: int | None = None
    prefetch_steps: int = 2
    filesystem: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.columns is not None and (isinstance(self.columns, str) or not self.columns
                                         or not all(isinstance(c, str) for c in self.columns)):
            raise ConfigError(f"Parquet(columns={self.columns!r}) must be a non-empty list of column names")
        check_read_options(self)

    def scan(self) -> ParquetLayout:
        """Every file's footer: the schema (checked alike across files), row groups and sizes."""
        import pyarrow.parquet as pq

        what = f"Parquet({self.urls!r})"
        files = resolve(self.urls, filesystem=self.filesystem, what=what)
        reader = FileReader(files, filesystem=self.filesystem, what=what)
        columns: tuple[str, ...] | None = tuple(self.columns) if self.columns is not None else None
        schema = None
        groups: list[tuple[int, int]] = []  # (file, row group) per block
        sizes: list[int] = []
        nbytes: list[int] = []
        for i, f in enumerate(files):
            with reader.open_input(i) as handle:
                try:
                    meta = pq.ParquetFile(handle).metadata
                except Exception as err:  # pyarrow raises ArrowInvalid and others for a bad footer
                    raise DataError(f"{f.url}: not a readable Parquet file ({err})") from err
                arrow = meta.schema.to_arrow_schema()
            if columns is None:
                columns = tuple(arrow.names)
            missing = [c for c in columns if c not in arrow.names]
            if missing:
                raise DataError(f"{f.url}: has no column {missing[0]!r} (its columns: {arrow.names})")
            fields = {c: arrow.field(c).type for c in columns}
            if schema is None:
                schema = fields
            elif fields != schema:
                bad = next(c for c in columns if fields[c] != schema[c])
                raise DataError(f"{f.url}: column {bad!r} is {fields[bad]} but {files[0].url} has it as {schema[bad]}; "
                                "every file must have the same schema")
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                groups.append((i, g))
                sizes.append(rg.num_rows)
                nbytes.append(rg.total_byte_size)
        if not sizes or not sum(sizes):
            raise DataError(f"{what}: the files hold no rows")
        assert columns is not None
        return ParquetLayout(source=self, files=files, columns=columns, groups=tuple(groups), block_sizes=tuple(sizes),
                             group_bytes=tuple(nbytes), cache_bytes=self.cache_bytes or 3 * self.window * max(nbytes))


@dataclass(frozen=True, kw_only=True)
class ParquetLayout(FromSource):
    """``Parquet`` scanned: what the owners read by."""

    source: Parquet
    files: tuple[DataFile, ...]
    columns: tuple[str, ...]
    groups: tuple[tuple[int, int], ...]
    block_sizes: tuple[int, ...]
    group_bytes: tuple[int, ...]
    cache_bytes: int

    @property
    def what(self) -> str:
        return f"Parquet({self.source.urls!r})"

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data: resuming over anything else is refused."""
        return {"kind": "Parquet", "files": [[f.url, f.size] for f in self.files], "columns": list(self.columns),
                "rows": list(self.block_sizes), "window": self.source.window}

    def block_bytes(self, block: int) -> int:
        return self.group_bytes[block]

    def read_block(self, block: int, files: FileReader) -> ParquetBlock:
        import pyarrow.parquet as pq

        index, group = self.groups[block]
        url = self.files[index].url

        def read() -> Any:
            with files.open_input(index) as handle:
                return pq.ParquetFile(handle).read_row_group(group, columns=list(self.columns))

        table = files.retrying(read, url, f"reading row group {group}")
        return ParquetBlock(columns={c: column_data(table.column(c)) for c in self.columns})


def column_data(column: Any) -> Any:
    """A column as what a sample reads: a numpy array (numbers), (values, offsets) (lists of
    numbers), or a Python list."""
    import pyarrow as pa

    array = column.combine_chunks()
    kind = array.type
    numeric = lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)  # noqa: E731
    if array.null_count == 0:
        if numeric(kind):
            return array.to_numpy(zero_copy_only=False)
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and numeric(kind.value_type) \
                and array.values.null_count == 0:
            return (array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy())
    return array.to_pylist()


@dataclass(frozen=True, kw_only=True)
class ParquetBlock:
    columns: dict[str, Any]

    @property
    def nbytes(self) -> int:
        total = 0
        for value in self.columns.values():
            parts = value if isinstance(value, tuple) else (value,)
            total += sum(p.nbytes if isinstance(p, np.ndarray) else 64 * len(p) for p in parts)
        return total

    def sample(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in self.columns.items():
            if isinstance(value, np.ndarray):
                out[name] = torch.as_tensor(value[i])
            elif isinstance(value, tuple):
                values, offsets = value
                out[name] = torch.from_numpy(np.array(values[offsets[i]:offsets[i + 1]]))
            else:
                out[name] = value[i]
        return out
