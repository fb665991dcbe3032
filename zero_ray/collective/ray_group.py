"""Process groups formed through ``ray.util.collective``.

GLOO: Ray's own ``reducescatter`` is a loop of all-reduces (twice the paper's traffic) and
torch's gloo ``reduce_scatter_tensor`` is slower than ``all_reduce``, so ``RingGroup`` runs
ring reduce-scatter and all-gather as point-to-point steps over the process group that
``ray.util.collective`` formed: each rank sends exactly ``(N-1)/N`` of the buffer, as the paper
counts. Every wait has a finite timeout (the process group itself has none that reaches a
blocked collective).

NCCL: ``NcclGroup`` uses ``ray.util.collective``'s native reduce-scatter and all-gather, which
are rings already.
"""

from __future__ import annotations

import datetime
import gc
import logging

import torch

from zero_ray.collective.group import ByteCounters, Collective, SoloGroup, chunks
from zero_ray.errors import CollectiveError, CollectiveTimeout, ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class RingGroup:
    """Ring collectives from isend/irecv over a torch.distributed gloo group."""

    def __init__(self, *, group_name: str, rank: int, world_size: int, timeout_s: float) -> None:
        import ray.util.collective as col
        import torch.distributed as dist

        self._dist = dist
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.counters = ByteCounters()
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = col.collective.get_group_handle(group_name)._pg
        self._next = (rank + 1) % world_size
        self._prev = (rank - 1) % world_size
        self._scratch: torch.Tensor | None = None

    @property
    def process_group(self) -> object:
        """The torch.distributed gloo group the ring runs over (None once aborted): the
        collectives benchmark times torch's own all-reduce on it."""
        return self._pg

    # -- the point-to-point step every ring collective is made of --------------------------------
    def _exchange(self, op: str, send: torch.Tensor, recv: torch.Tensor) -> None:
        dist = self._dist
        self.counters.add(op, send.numel() * send.element_size())
        try:
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, send, self._next, group=self._pg),
                dist.P2POp(dist.irecv, recv, self._prev, group=self._pg),
            ])
            for work in works:
                work.wait(timeout=self._timeout)
        except RuntimeError as err:
            text = str(err)
            if "Timed out" in text or "timeout" in text.lower():
                raise CollectiveTimeout(
                    f"{op} on rank {self.rank} of {self.world_size} timed out after "
                    f"{self._timeout.total_seconds():g}s waiting for ranks {self._prev}/{self._next}"
                ) from err
            raise CollectiveError(f"{op} on rank {self.rank} of {self.world_size} failed: {text}") from err

    def _scratch_like(self, chunk: torch.Tensor) -> torch.Tensor:
        s = self._scratch
        if s is None or s.numel() < chunk.numel() or s.dtype != chunk.dtype or s.device != chunk.device:
            s = self._scratch = torch.empty(chunk.numel(), dtype=chunk.dtype, device=chunk.device)
        return s[: chunk.numel()]

    def release_scratch(self) -> None:
        """Drop the receive buffer (it is sized by the largest chunk seen)."""
        self._scratch = None

    # -- collectives ------------------------------------------------------------------------------
    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        tmp = self._scratch_like(parts[0])
        for k in range(n - 1):
            self._exchange(op, parts[(r - k - 1) % n], tmp)
            parts[(r - k - 2) % n].add_(tmp)
        return parts[r]

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        for k in range(n - 1):
            self._exchange(op, parts[(r - k) % n], parts[(r - k - 1) % n])

    def all_reduce_(self, buf: torch.Tensor) -> None:
        # Reduce-scatter then all-gather: each chunk is summed once, on its owner, so every
        # rank ends with identical bits.
        self.reduce_scatter_(buf, op="all_reduce")
        self.all_gather_(buf, op="all_reduce")

    def all_reduce_values(self, values: list[float]) -> list[float]:
        n = self.world_size
        size = -(-max(1, len(values)) // n) * n
        buf = torch.zeros(size, dtype=torch.float64)
        buf[: len(values)] = torch.tensor(values, dtype=torch.float64)
        self.reduce_scatter_(buf, op="scalars")
        self.all_gather_(buf, op="scalars")
        return buf[: len(values)].tolist()

    def barrier(self) -> None:
        self.all_reduce_values([0.0])

    def destroy(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Tear the group down and drop every reference to it, so its sockets close: peers
        blocked waiting on this rank then fail at once (measured: destroying the group while a
        reference survives leaves them blocked until their timeout)."""
        destroy_group(self.group_name)
        self._pg = None
        self._scratch = None
        gc.collect()


class NcclGroup:
    """``ray.util.collective``'s NCCL ring collectives on CUDA tensors."""

    def __init__(self, *, group_name: str, rank: int, world_size: int, timeout_s: float) -> None:
        import ray.util.collective as col

        self._col = col
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.counters = ByteCounters()
        self.timeout_s = timeout_s

    def _count(self, op: str, buf: torch.Tensor) -> None:
        # NCCL's ring sends (N-1) of the N chunks; its internals are not observable from here.
        self.counters.add(op, (self.world_size - 1) * (buf.numel() // self.world_size) * buf.element_size())

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        parts = list(chunks(buf, self.world_size))
        out = parts[self.rank]
        result = torch.empty_like(out)
        self._col.reducescatter(result, parts, group_name=self.group_name)
        out.copy_(result)
        self._count(op, buf)
        return out

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        parts = list(chunks(buf, self.world_size))
        self._col.allgather(parts, parts[self.rank].clone(), group_name=self.group_name)
        self._count(op, buf)

    def all_reduce_(self, buf: torch.Tensor) -> None:
        self._col.allreduce(buf, group_name=self.group_name)
        self._count("all_reduce", buf)
        self._count("all_reduce", buf)

    def all_reduce_values(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device="cuda")
        self._col.allreduce(t, group_name=self.group_name)
        return t.tolist()

    def barrier(self) -> None:
        self._col.barrier(group_name=self.group_name)

    def destroy(self) -> None:
        self._col.destroy_collective_group(self.group_name)

    def abort(self) -> None:
        self.destroy()


def form_group(*, backend: str, group_name: str, rank: int, world_size: int, timeout_s: float) -> Collective:
    """Join ``group_name`` (all ranks call this concurrently, each in its own actor)."""
    if world_size == 1:
        return SoloGroup()
    if backend not in BACKENDS:
        raise ConfigError(f"{backend=} is not supported; use one of {BACKENDS}")
    import ray.util.collective as col

    try:
        col.init_collective_group(world_size, rank, backend=backend, group_name=group_name,
                                  gloo_timeout=int(timeout_s * 1000))
    except Exception as err:  # rendezvous failures come back as assorted exception types
        raise CollectiveError(f"rank {rank} could not join collective group {group_name!r}: {err}") from err
    cls = RingGroup if backend == "gloo" else NcclGroup
    return cls(group_name=group_name, rank=rank, world_size=world_size, timeout_s=timeout_s)


def destroy_group(group_name: str) -> None:
    """Leave ``group_name`` and tear down the process's default torch.distributed group, so a
    group of another generation can be formed in this process (named gloo groups cannot be
    re-formed while the default group that carries them is broken)."""
    import ray.util.collective as col
    import torch.distributed as dist

    try:
        if col.is_group_initialized(group_name):
            col.destroy_collective_group(group_name)
    except Exception:  # a broken group may fail to tear down cleanly; the process group goes next
        log.warning("destroying collective group %r failed", group_name, exc_info=True)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            log.warning("destroying the default process group failed", exc_info=True)
