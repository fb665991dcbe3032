"""Rank files: safetensors written as a stream with per-block checksums, read by byte range.

The files are standard safetensors (``safetensors.safe_open`` reads them); they are written
here rather than by ``safetensors.torch.save_file`` so that the sha256 of the file and of every
``chunk_bytes`` block is computed while the bytes go out, and read here so that a new rank reads
only the blocks holding the ranges it needs, each verified before use. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zero_ray.checkpoint.format import Entry, ShardFile
from zero_ray.checkpoint.storage import Storage
from zero_ray.errors import CheckpointError

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class Item:
    """A tensor to write: its safetensors key and what it is (``Entry`` without the offset)."""

    key: str
    kind: str
    name: str
    start: int
    end: int
    tensor: torch.Tensor
    offsets: tuple[int, ...] = ()  # a TP slice's, as Entry's
    extent: tuple[int, ...] = ()


class _HashingWriter:
    """Writes bytes, hashing the whole stream and each aligned block of ``chunk_bytes``."""

    def __init__(self, fh: object, chunk_bytes: int) -> None:
        self._fh = fh
        self._chunk = chunk_bytes
        self._file = hashlib.sha256()
        self._block = hashlib.sha256()
        self._in_block = 0
        self.size = 0
        self.blocks: list[str] = []

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self._fh.write(view)  # type: ignore[attr-defined]
        self._file.update(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), self._chunk - self._in_block)
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == self._chunk:
                self.blocks.append(self._block.hexdigest())
                self._block, self._in_block = hashlib.sha256(), 0

    def finish(self) -> tuple[str, list[str]]:
        if self._in_block:
            self.blocks.append(self._block.hexdigest())
        return self._file.hexdigest(), self.blocks


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in safetensors' layout: row-major, in host byte order (little-endian on
    every platform zero_ray runs on)."""
    t = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def element_size(dtype: str) -> int:
    """Bytes per element of the safetensors dtype named ``dtype`` (``"F32"``, ...)."""
    if dtype not in _TORCH:
        raise CheckpointError(f"dtype {dtype!r} is not one a checkpoint stores ({sorted(_TORCH)}); the manifest is "
                              "corrupt or from a newer zero_ray")
    return _TORCH[dtype].itemsize


def safetensors_header(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[bytes, list[int]]:
    """The first bytes of a safetensors file holding ``tensors`` (key, dtype name, shape) stored
    back to back in this order: the length prefix and the JSON header, and each tensor's file
    offset. Known from shapes alone, so a writer can stream the data after it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "writer": "zero_ray"}}
    offset, starts = 0, []
    for key, dtype, shape in tensors:
        nbytes = math.prod(shape) * element_size(dtype)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts.append(offset)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    data_start = 8 + len(blob)
    return len(blob).to_bytes(8, "little") + blob, [data_start + s for s in starts]


def write_shard(storage: Storage, path: str, items: Sequence[Item], *, rank: int, name: str,
                chunk_bytes: int) -> ShardFile:
    """Write ``items`` to ``path`` as one safetensors file (durable on return) and describe it."""
    for it in items:
        if it.tensor.dtype not in _DTYPES:
            raise CheckpointError(f"{it.key}: dtype {it.tensor.dtype} cannot be stored in a checkpoint")
    head, offsets = safetensors_header([(it.key, _DTYPES[it.tensor.dtype], tuple(it.tensor.shape)) for it in items])
    entries: list[Entry] = []
    with storage.open_write(path) as fh:
        out = _HashingWriter(fh, chunk_bytes)
        out.write(head)
        for it, offset in zip(items, offsets):
            entries.append(Entry(key=it.key, kind=it.kind, name=it.name, start=it.start, end=it.end,
                                 offset=offset, dtype=_DTYPES[it.tensor.dtype], shape=tuple(it.tensor.shape),
                                 offsets=it.offsets, extent=it.extent))
            out.write(tensor_bytes(it.tensor))
        sha, blocks = out.finish()
    return ShardFile(rank=rank, name=name, size=out.size, sha256=sha, chunk_bytes=chunk_bytes,
                     chunk_sha256=tuple(blocks), entries=tuple(entries))


class ShardReader:
    """Ranged, verified reads of one rank file. Every block read is checked against the
    manifest's sha256 before any byte of it is used; a verified block is kept until the next
    read moves past it (consecutive fragments usually share blocks)."""

    def __init__(self, storage: Storage, path: str, record: ShardFile) -> None:
        self.path = path
        self.record = record
        try:
            self._file = storage.open_ranged(path)  # one lookup: present, and its size
        except FileNotFoundError:
            raise CheckpointError(f"shard file {path} is missing (rank {record.rank}); the checkpoint is "
                                  "incomplete") from None
        size = self._file.size
        if size != record.size:
            raise CheckpointError(f"shard file {path} has {size} bytes but the manifest records {record.size}: "
                                  "it is truncated or was replaced")
        self._cached: tuple[int, bytes] | None = None  # (first block index, bytes of the blocks)
        self.bytes_read = 0

    def _blocks(self, first: int, last: int) -> bytes:
        cb, rec = self.record.chunk_bytes, self.record
        if self._cached is not None:
            c0, data = self._cached
            if c0 <= first and last < c0 + -(-len(data) // cb):
                return data[(first - c0) * cb:(last + 1 - c0) * cb]
        lo, hi = first * cb, min(rec.size, (last + 1) * cb)
        data = self._file.read(lo, hi - lo)  # one ranged read (a ranged GET on an object store)
        self.bytes_read += len(data)
        for b in range(first, last + 1):
            block = data[(b - first) * cb:(b + 1 - first) * cb]
            if b >= len(rec.chunk_sha256) or hashlib.sha256(block).hexdigest() != rec.chunk_sha256[b]:
                raise CheckpointError(f"shard file {self.path}: checksum mismatch in bytes [{b * cb}, "
                                      f"{b * cb + len(block)}) (block {b}); the file is corrupt")
        self._cached = (first, data)
        return data

    def read(self, entry: Entry, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``entry`` as a new CPU tensor."""
        dtype = _TORCH[entry.dtype]
        size = torch.empty((), dtype=dtype).element_size()
        lo, hi = entry.offset + start * size, entry.offset + end * size
        if end <= start:
            return torch.empty(0, dtype=dtype)
        cb = self.record.chunk_bytes
        first, last = lo // cb, (hi - 1) // cb
        data = self._blocks(first, last)
        raw = bytearray(data[lo - first * cb:hi - first * cb])
        return torch.frombuffer(raw, dtype=dtype)

    def read_entry(self, entry: Entry) -> torch.Tensor:
        """The whole entry in its stored shape."""
        return self.read(entry, 0, math.prod(entry.shape)).reshape(entry.shape)

    def verify(self) -> None:
        """Check every block and the whole-file sha256 (reads the whole file)."""
        cb, rec = self.record.chunk_bytes, self.record
        whole = hashlib.sha256()
        per = max(1, (64 * 2**20) // cb)
        for first in range(0, len(rec.chunk_sha256), per):
            self._cached = None
            data = self._blocks(first, min(len(rec.chunk_sha256), first + per) - 1)
            whole.update(data)
        self._cached = None
        if whole.hexdigest() != rec.sha256:
            raise CheckpointError(f"shard file {self.path}: sha256 {whole.hexdigest()} differs from the manifest's "
                                  f"{rec.sha256}; the file is corrupt")

