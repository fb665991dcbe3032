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
import functools
import gc
import logging
import threading
from typing import Any

import torch

from zero_ray.collective.collective_api import ByteCounters, Collective, SoloGroup, chunks, ring_all_gather, ring_reduce_scatter
from zero_ray.collective.rendezvous import RendezvousAborted, form_default_group
from zero_ray.compat.torch_private import default_pg_timeout, reset_group_count
from zero_ray.errors import CollectiveError, CollectiveTimeout, ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


# Up to this many bytes a reduce-scatter or all-gather goes to every peer at once (one round
# of messages) rather than round the ring (N-1 rounds, each waiting for the one before): small
# collectives are bound by the latency of a round, not by bandwidth. Each rank still sends
# (N-1)/N of the buffer; the reduce-scatter's receive buffer grows to (N-1)/N of it, so the
# bound also caps that buffer. Larger buffers take the ring, whose receive buffer is 1/N.
DIRECT_MAX_BYTES = 16 * 2**20


_ABORT_TAG = 0x5A5A  # no collective sends with it: a receive on it only ever times out


class RingGroup:
    """Ring collectives from isend/irecv over a torch.distributed gloo group (direct sends to
    every peer for buffers up to ``DIRECT_MAX_BYTES``)."""

    def __init__(self, *, group_name: str, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        from zero_ray.compat.ray_private import process_group_of

        self._dist = dist
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.counters = ByteCounters()
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._pg = process_group_of(group_name)
        self._next = (rank + 1) % world_size
        self._prev = (rank - 1) % world_size
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def process_group(self) -> object:
        """The torch.distributed gloo group the ring runs over (None once aborted): the
        collectives benchmark times torch's own all-reduce on it."""
        return self._pg

    # -- the point-to-point round every collective is made of -------------------------------------
    def _round(self, op: str, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive ``(tensor, peer rank)`` at once and wait for them all."""
        dist = self._dist
        for t, peer in sends:
            self.counters.add(op, t.numel() * t.element_size(), peer=peer)
        pg = self._pg  # read once: an abort on another thread drops it
        if pg is None:  # a job queued on a communication thread after an abort
            raise CollectiveError(f"{op} on rank {self.rank} of {self.world_size}: the group was aborted")
        # A gloo work keeps its group's sockets open, and an exception raised here keeps this
        # frame: so the works are dropped on the way out, or an aborted group would stay open
        # for the peers still blocked on it (measured: at 4 owners a survivor blocked on a failed
        # one was dropped as stuck after settle_timeout_s; benchmarks.recovery_time).
        works: list[Any] = []
        try:
            works += [dist.isend(t, peer, group=pg) for t, peer in sends]
            works += [dist.irecv(t, peer, group=pg) for t, peer in recvs]
            while works:  # each once: a second wait on a gloo receive waits for another message
                works[0].wait(timeout=self._timeout)
                works.pop(0)
        except RuntimeError as err:
            text = str(err)
            peers = sorted({peer for _, peer in sends + recvs})
            if "Timed out" in text or "timeout" in text.lower():
                raise CollectiveTimeout(
                    f"{op} on rank {self.rank} of {self.world_size} timed out after "
                    f"{self._timeout.total_seconds():g}s waiting for ranks {peers}"
                ) from err
            raise CollectiveError(f"{op} on rank {self.rank} of {self.world_size} failed: {text}") from err
        except ValueError as err:  # torch: "Group ... is not registered": destroyed by an abort meanwhile
            raise CollectiveError(f"{op} on rank {self.rank} of {self.world_size}: the group was aborted "
                                  f"while the job ran ({err})") from err
        finally:
            works.clear()

    def _exchange(self, op: str, send: torch.Tensor, recv: torch.Tensor) -> None:
        """One ring step: send to the next rank while receiving from the previous one."""
        self._round(op, [(send, self._next)], [(recv, self._prev)])

    def _scratch_for(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        # One receive buffer per dtype and device, grown to the largest request and kept: the
        # step's few float64 scalars must not replace the gradient chunks' buffer, since a
        # fresh buffer of that size costs a page fault per page on every receive into it
        # (measured: a 32 MiB exchange took 40 ms instead of 20 ms when it did).
        key = (like.dtype, like.device)
        s = self._scratch.get(key)
        if s is None or s.numel() < numel:
            s = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    def release_scratch(self) -> None:
        """Drop the receive buffers (each is sized by the largest request seen)."""
        self._scratch = {}

    def _direct(self, buf: torch.Tensor) -> bool:
        return self.world_size > 2 and buf.numel() * buf.element_size() <= DIRECT_MAX_BYTES

    def _peers(self) -> list[int]:
        """The other ranks in ring order from this one: r+1, r+2, ..., r-1."""
        return [(self.rank + k) % self.world_size for k in range(1, self.world_size)]

    # -- collectives ------------------------------------------------------------------------------
    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        if self._direct(buf):
            # Every peer's copy of this rank's chunk, summed in the ring's order (r+1, r+2, ...,
            # r-1, then r's own): the same additions as round the ring, so the same bits.
            peers = self._peers()
            got = self._scratch_for((n - 1) * parts[0].numel(), parts[0]).chunk(n - 1)
            self._round(op, [(parts[k], k) for k in peers], list(zip(got, peers)))
            for k in range(1, n - 1):
                got[0].add_(got[k])
            parts[r].add_(got[0])
            return parts[r]
        tmp = self._scratch_for(parts[0].numel(), parts[0])
        return ring_reduce_scatter(parts, r, functools.partial(self._exchange, op), tmp)

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        if self._direct(buf):
            peers = self._peers()
            self._round(op, [(parts[r], k) for k in peers], [(parts[k], k) for k in peers])
            return
        ring_all_gather(parts, r, functools.partial(self._exchange, op))

    def all_reduce_(self, buf: torch.Tensor) -> None:
        # Reduce-scatter then all-gather: each chunk is summed once, on its owner, so every
        # rank ends with identical bits.
        self.reduce_scatter_(buf, op="all_reduce")
        self.all_gather_(buf, op="all_reduce")

    def all_reduce_values(self, values: list[float]) -> list[float]:
        # A few scalars: every rank sends its values to every peer in one round and sums all
        # ranks' values in rank order, so every rank gets identical bits after one round trip
        # (a ring would take 2(N-1) rounds: measured 20 ms at 4 ranks on 2 cores).
        mine = torch.tensor([float(v) for v in values] or [0.0], dtype=torch.float64)
        rows = [mine if k == self.rank else torch.empty_like(mine) for k in range(self.world_size)]
        peers = self._peers()
        self._round("scalars", [(mine, k) for k in peers], [(rows[k], k) for k in peers])
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        return total[: len(values)].tolist()

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        if sends or recvs:
            self._round(op, sends, recvs)

    def barrier(self) -> None:
        self.all_reduce_values([0.0])

    def _close_pairs(self) -> None:
        # gloo has no way to cancel a posted wait, but a wait that times out closes its
        # connection to that peer, failing every wait on it on both sides (measured: two live
        # ranks blocked on each other both fail within 10 ms). So post a receive nobody sends
        # (its own tag) to each peer and let it time out at once.
        pg = self._pg
        if pg is None:
            return
        probe = torch.empty(1)
        for peer in self._peers():
            try:
                pg.recv([probe], peer, _ABORT_TAG).wait(datetime.timedelta(milliseconds=1))
            except RuntimeError:
                pass  # the expected timeout, or the connection was already gone

    def destroy(self) -> None:
        """Tear the group down and drop every reference to it, so its sockets close (measured:
        destroying the group while a reference survives leaves peers blocked until their
        timeout)."""
        self._pg = None  # first: a job starting meanwhile finds the group gone, not half torn down
        destroy_group(self.group_name)
        self._scratch = {}
        gc.collect()

    def abort(self) -> None:
        """Close every connection to the peers, then destroy the group: peers blocked waiting on
        this rank, and this rank's own waits, fail at once. Destroying alone does neither while a
        wait holds the group: a survivor blocked on another live one stayed blocked past
        ``settle_timeout_s`` and was dropped as stuck (tests/integration/test_replica_recovery.py,
        2 runs in 7 under load; tests/collective/test_abort.py)."""
        self._close_pairs()
        self.destroy()


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
        self.counters.add(op, (self.world_size - 1) * (buf.numel() // self.world_size) * buf.element_size(),
                          peer=(self.rank + 1) % self.world_size)

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

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        # ray.util.collective's NCCL send/recv block one message at a time, so every pair of
        # ranks exchanges in one global order (pairs by (low, high) rank; the lower rank sends
        # first): the earliest unfinished pair always has both ranks waiting on it.
        peers = sorted({p for _, p in sends} | {p for _, p in recvs},
                       key=lambda p: (min(p, self.rank), max(p, self.rank)))
        for peer in peers:
            out = [t for t, p in sends if p == peer]
            into = [t for t, p in recvs if p == peer]
            steps = [("send", out), ("recv", into)] if self.rank < peer else [("recv", into), ("send", out)]
            for what, tensors in steps:
                for t in tensors:
                    if what == "send":
                        self._col.send(t, peer, group_name=self.group_name)
                        self.counters.add(op, t.numel() * t.element_size(), peer=peer)
                    else:
                        self._col.recv(t, peer, group_name=self.group_name)

    def barrier(self) -> None:
        self._col.barrier(group_name=self.group_name)

    def destroy(self) -> None:
        self._col.destroy_collective_group(self.group_name)

    def abort(self) -> None:
        self.destroy()


def form_group(*, backend: str, group_name: str, rank: int, world_size: int, timeout_s: float,
               abort: threading.Event | None = None) -> Collective:
    """Join ``group_name`` (all ranks call this concurrently, each in its own actor); every
    wait, the rendezvous included, is bounded by ``timeout_s``, and a gloo formation gives up at
    once when ``abort`` is set (another thread: a member was lost before it arrived), leaving
    the process free to form the next group."""
    if world_size == 1:
        return SoloGroup()
    if backend not in BACKENDS:
        raise ConfigError(f"{backend=} is not supported; use one of {BACKENDS}")
    import ray.util.collective as col

    try:
        # bounds the gloo group ray.util.collective forms with no timeout of its own (torch's 30 min)
        with default_pg_timeout(timeout_s):
            if backend == "gloo":
                # The default group over an abortable rendezvous; ray.util.collective's named
                # group is then a new_group over it, whose barrier uses the same store.
                form_default_group(group_name, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                   abort=abort or threading.Event())
            col.init_collective_group(world_size, rank, backend=backend, group_name=group_name,
                                      gloo_timeout=int(timeout_s * 1000))
    except RendezvousAborted:
        _drop_default_group()
        raise
    except Exception as err:  # rendezvous failures come back as assorted exception types
        _drop_default_group()
        if abort is not None and abort.is_set():
            raise RendezvousAborted(f"rank {rank}: forming {group_name!r} was aborted ({err})") from err
        raise CollectiveError(f"rank {rank} could not join collective group {group_name!r}: {err}") from err
    cls = RingGroup if backend == "gloo" else NcclGroup
    return cls(group_name=group_name, rank=rank, world_size=world_size, timeout_s=timeout_s)


def _drop_default_group() -> None:
    """After a failed formation: no half-made default group may block the next one."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            log.warning("destroying a half-formed default process group failed", exc_info=True)
    # torch names the default group after a per-process counter (its keys in the store start
    # with it) and resets it only when it destroys a formed default group; a formation that
    # failed half-way left it counted, and this process would then wait on keys no fresh peer
    # writes. Reset it as torch's own destroy does.
    reset_group_count()


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
