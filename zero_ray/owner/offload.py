"""StateFiles: one owner's optimizer state on local disk (``Offload(optimizer="nvme")``).

Each state buffer is a file of its own under ``path``, unlinked as soon as it is created (so
owners may share a directory, nothing can open or clobber the file by name, and the owner's end,
a SIGKILL included, frees it), preallocated (a full disk fails the allocation, with the path
named, rather than a later write) and mapped into the owner with ``mmap``. torch reads and writes it as any tensor, so
checkpoints, resizes, peer snapshots and restores need nothing of their own.

The I/O is the kernel's page cache: ``prefetch`` asks for a buffer's pages to be read ahead
(``MADV_WILLNEED``, asynchronous) and ``evict`` takes them out of the owner's memory
(``MADV_DONTNEED``; on a shared file mapping that only unmaps them, the kernel writes dirty
pages back). No Python thread does I/O, so none holds the GIL for it.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref

import torch

from zero_ray.errors import ConfigError, ResourceError


class StateFiles:
    """The files one owner's offloaded state buffers live in, under ``path``."""

    def __init__(self, path: str, *, rank: int) -> None:
        self.directory = path
        self.rank = rank
        try:
            os.makedirs(path, exist_ok=True)
            os.close(self._create())
        except OSError as err:
            raise ConfigError(f"Offload(path={path!r}) cannot hold rank {rank}'s optimizer state: {err.strerror} "
                              f"({type(err).__name__}); give a writable directory on the owners' local disk") from err
        self._maps: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()

    def _create(self) -> int:
        """A new file of this owner's, already unlinked: its descriptor."""
        fd, name = tempfile.mkstemp(prefix=f"zero_ray-rank{self.rank}-", dir=self.directory)
        os.unlink(name)
        return fd

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D tensor of ``numel`` elements held in a file of its own."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)
        fd = self._create()
        try:
            os.posix_fallocate(fd, 0, nbytes)  # blocks on disk now: a full disk fails here, not in a write
            mapped = mmap.mmap(fd, nbytes)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceError(f"rank {self.rank}'s optimizer state needs {nbytes} more bytes under "
                                    f"{self.directory} but the disk is full ({err.strerror}); free space there or "
                                    "give Offload(path=...) a larger disk") from err
            raise
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mapped, dtype=dtype)  # keeps the mapping alive while the tensor lives
        self._maps[tensor.data_ptr()] = mapped
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._maps

    def prefetch(self, tensor: torch.Tensor) -> None:
        """Start reading ``tensor``'s pages in (returns at once)."""
        mapped = self._maps.get(tensor.data_ptr())
        if mapped is not None:
            mapped.madvise(mmap.MADV_WILLNEED)

    def evict(self, tensor: torch.Tensor) -> None:
        """Take ``tensor``'s pages out of this process's memory; its values stay in the file."""
        mapped = self._maps.get(tensor.data_ptr())
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)

