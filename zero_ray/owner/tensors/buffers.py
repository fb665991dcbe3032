"""BufferPool: reusable flat buffers, so temporary memory stays constant whatever the model size
(ZeRO-R's constant-size buffers).

Two uses: stage-3 units' gathered parameters (``acquire``: the lowest free buffer, or None so
that the caller evicts) and gradient staging before a reduce-scatter (``take``: an idle buffer,
a new one while the pool has room, else the one released longest ago once its collective is
done, else a temporary buffer counted in the peak). A buffer remembers the last collective that
reads it (``done``); whoever takes it next waits for that before writing.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PoolBuffer:
    """One flat buffer and who holds it (a group or unit index; None when free)."""

    index: int  # -1 for a temporary buffer
    tensor: torch.Tensor
    holder: int | None = None
    done: Future[Any] | None = None

    @property
    def temporary(self) -> bool:
        return self.index < 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def settle(self) -> None:
        """Wait for the last collective that reads this buffer (it raises what that raised)."""
        if self.done is not None:
            done, self.done = self.done, None
            done.result()


class BufferPool:
    """At most ``count`` buffers of ``numel`` elements: allocated up front as views of one
    contiguous block (``preallocate``: ZeRO-R's M_D, nothing for the allocator to fragment), or
    each on first need."""

    def __init__(self, *, name: str, count: int, numel: int, dtype: torch.dtype, device: torch.device,
                 preallocate: bool) -> None:
        self.name = name
        self.count = count
        self.numel = numel
        self._dtype, self._device = dtype, device
        self.buffers: list[PoolBuffer] = []
        self._free: list[PoolBuffer] = []  # released pool buffers, oldest first
        self._temporary_bytes = 0
        self.peak_bytes = 0  # pool buffers plus the temporary ones in use, at most
        self.block: torch.Tensor | None = None  # the contiguous block of a preallocated pool
        if preallocate and count and numel:
            self.block = torch.zeros(count * numel, dtype=dtype, device=device)
            for view in self.block.view(count, numel):
                self._free.append(self._add(view))

    def _add(self, tensor: torch.Tensor) -> PoolBuffer:
        buf = PoolBuffer(index=len(self.buffers), tensor=tensor)
        self.buffers.append(buf)
        self._note_peak()
        return buf

    def _allocate(self) -> PoolBuffer:
        return self._add(torch.zeros(self.numel, dtype=self._dtype, device=self._device))

    def buffer_of(self, t: torch.Tensor) -> PoolBuffer | None:
        """The pool buffer whose memory ``t`` views, if any."""
        ptr = t.untyped_storage().data_ptr()
        for b in self.buffers:
            if b.tensor.untyped_storage().data_ptr() == ptr:
                start = b.tensor.data_ptr()
                if start <= t.data_ptr() < start + b.nbytes:
                    return b
        return None

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes + self._temporary_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's own buffers (temporary ones excluded)."""
        return sum(b.nbytes for b in self.buffers)

    def holders(self) -> list[int]:
        return [b.holder for b in self.buffers if b.holder is not None]

    def acquire(self, holder: int) -> PoolBuffer | None:
        """The lowest-numbered free buffer (every rank makes the same choice), or None."""
        for buf in self._free_in_order():
            self._free.remove(buf)
            buf.holder = holder
            return buf
        if len(self.buffers) < self.count:
            buf = self._allocate()
            buf.holder = holder
            return buf
        return None

    def _free_in_order(self) -> list[PoolBuffer]:
        return sorted(self._free, key=lambda b: b.index)

    def take(self, holder: int, numel: int) -> PoolBuffer:
        """A buffer to fill now, its previous collective finished: an idle free buffer, else a
        new one while the pool has room, else the one released longest ago (waiting for its
        collective), else a temporary buffer of ``numel`` (every pool buffer is being filled)."""
        idle = next((b for b in self._free if b.done is None or b.done.done()), None)
        if idle is not None:
            buf = idle
            self._free.remove(buf)
        elif len(self.buffers) < self.count:
            buf = self._allocate()
        elif self._free:
            buf = self._free.pop(0)
        else:
            log.warning("%s: all %d buffers are being filled (gradients arrived out of order); "
                        "using a temporary one", self.name, self.count)
            buf = PoolBuffer(index=-1, tensor=torch.empty(numel, dtype=self._dtype, device=self._device))
            self._temporary_bytes += buf.nbytes
            self._note_peak()
        buf.settle()
        buf.holder = holder
        return buf

    def release(self, buf: PoolBuffer) -> None:
        """``buf``'s holder is done filling or reading it (a collective may still read it)."""
        buf.holder = None
        if not buf.temporary:
            self._free.append(buf)

    def end_micro_batch(self) -> None:
        """Temporary buffers of the micro-batch are gone (their collectives have finished)."""
        self._temporary_bytes = 0

    def reset(self) -> None:
        """Forget holders and collectives (after an interrupted step; the stream is drained)."""
        for b in self.buffers:
            b.holder, b.done = None, None
        self._free = list(self.buffers)
        self._temporary_bytes = 0
