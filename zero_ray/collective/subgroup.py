"""SubGroup: collectives among some ranks of a world group, as point-to-point rounds.

A shard group, a replica group, a node: each is a list of world ranks. Rather than a process
group of its own (gloo groups are formed by every rank of the world together, one
``new_group`` per subgroup), a SubGroup runs its collectives as rounds of ``send_recv`` on the
world group, as ``RingGroup`` does: every member of a subgroup issues the same rounds in the same
order, and disjoint subgroups run at once. The world group counts every message by the world
rank it went to, so bytes split into inside-node and cross-node wherever they were sent from.

Plain collectives go round a ring (each member sends ``(m-1)/m`` of the buffer). Coded ones
(``codecs``: bf16, blockwise int8 / int4) send encoded bytes in one round to every member: the
reduce-scatter is an all-to-all (each member sums what the others encoded, its own chunk in full
precision, in member order), the all-gather sends each member's encoded chunk to all; every
member decodes its own chunk too, so all hold identical values.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from zero_ray.collective.codecs import Codec
from zero_ray.collective.collective_api import ByteCounters, Collective, chunks, ring_all_gather, ring_reduce_scatter
from zero_ray.errors import ConfigError


class SubGroup:
    """The Collective protocol over ``members`` (world ranks, in this group's rank order) of
    ``world``; this process is world rank ``me``. ``scalars``: where ``all_reduce_values`` sums
    (the world, for a group the model state is sharded over while the step's norm, marks and
    counts span every rank: tensor parallelism's data-parallel group); None: the members.
    ``label``: put before every op name it counts (``"tp_"``: a TP group's bytes apart from
    ZeRO's in the same counters)."""

    def __init__(self, world: Collective, members: Sequence[int], *, me: int,
                 scalars: Collective | None = None, label: str = "") -> None:
        if me not in members:
            raise ConfigError(f"world rank {me} is not among the subgroup's members {list(members)}")
        self.world = world
        self.members = tuple(members)
        self.rank = self.members.index(me)
        self.world_size = len(self.members)
        self.counters: ByteCounters = world.counters
        self._scalars = scalars
        self.label = label
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def peer(self, rank: int) -> int:
        """The world rank of this group's ``rank``."""
        return self.members[rank]

    def _scratch_for(self, numel: int, like: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (dtype or like.dtype, like.device)
        s = self._scratch.get(key)
        if s is None or s.numel() < numel:
            s = self._scratch[key] = torch.empty(numel, dtype=key[0], device=like.device)
        return s[:numel]

    def _exchange(self, op: str, send: torch.Tensor, recv: torch.Tensor) -> None:
        n, r = self.world_size, self.rank
        self.world.send_recv([(send, self.members[(r + 1) % n])], [(recv, self.members[(r - 1) % n])],
                             op=self.label + op)

    # -- plain rings ----------------------------------------------------------------------------
    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        if n == 1:
            return parts[0]
        tmp = self._scratch_for(parts[0].numel(), parts[0])
        return ring_reduce_scatter(parts, r, functools.partial(self._exchange, op), tmp)

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        ring_all_gather(chunks(buf, self.world_size), self.rank, functools.partial(self._exchange, op))

    def all_reduce_(self, buf: torch.Tensor, *, op: str = "all_reduce") -> None:
        self.reduce_scatter_(buf, op=op)
        self.all_gather_(buf, op=op)

    def all_reduce_values(self, values: list[float]) -> list[float]:
        if self._scalars is not None:
            return self._scalars.all_reduce_values(values)
        # Rarely used (the engine's scalars span the world group): the ring all-reduce of a
        # small float64 buffer, identical bits on every member.
        n = self.world_size
        buf = torch.zeros(-(-max(1, len(values)) // n) * n, dtype=torch.float64)
        buf[:len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self.all_reduce_(buf, op="scalars")
        return buf[:len(values)].tolist()

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        self.world.send_recv([(t, self.members[p]) for t, p in sends], [(t, self.members[p]) for t, p in recvs],
                             op=self.label + op)

    def barrier(self) -> None:
        self.all_reduce_values([0.0])

    def destroy(self) -> None:
        return None

    def abort(self) -> None:
        self.world.abort()

    # -- coded collectives --------------------------------------------------------------------------
    def all_gather_coded_(self, buf: torch.Tensor, codec: Codec, *, op: str) -> None:
        """All-gather ``buf`` with every chunk sent encoded; each chunk, this rank's included,
        ends as its decoded value."""
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        size = codec.nbytes(parts[0].numel())
        wire = self._scratch_for(n * size, buf, dtype=torch.uint8).view(n, size)
        codec.encode(parts[r], wire[r])
        # Encoded chunks are small: one round to every peer (a ring's n - 1 rounds each wait for
        # the one before), the same bytes sent
        peers = [k for k in range(n) if k != r]
        self.world.send_recv([(wire[r], self.members[k]) for k in peers], [(wire[k], self.members[k]) for k in peers],
                             op=self.label + op)
        for k in range(n):
            codec.decode(wire[k], parts[k])

    def reduce_scatter_coded_(self, buf: torch.Tensor, codec: Codec, *, op: str) -> torch.Tensor:
        """Reduce-scatter ``buf`` in one all-to-all round of encoded chunks; this rank's chunk
        becomes the sum, in member order, of its own values and the others' decoded ones."""
        n, r = self.world_size, self.rank
        parts = chunks(buf, n)
        if n == 1:
            return parts[0]
        size = codec.nbytes(parts[0].numel())
        wire = self._scratch_for(2 * n * size, buf, dtype=torch.uint8).view(2, n, size)
        out, into = wire[0], wire[1]
        peers = [k for k in range(n) if k != r]
        for k in peers:
            codec.encode(parts[k], out[k])
        self.world.send_recv([(out[k], self.members[k]) for k in peers], [(into[k], self.members[k]) for k in peers],
                             op=self.label + op)
        total = torch.zeros_like(parts[r], dtype=torch.float32)
        got = torch.empty_like(total)
        for k in range(n):
            if k == r:
                total.add_(parts[r])
            else:
                codec.decode(into[k], got)
                total.add_(got)
        parts[r].copy_(total)
        return parts[r]

    def all_reduce_coded_(self, buf: torch.Tensor, codec: Codec, *, op: str) -> None:
        """Coded reduce-scatter, then coded all-gather: identical values on every member."""
        self.reduce_scatter_coded_(buf, codec, op=op)
        self.all_gather_coded_(buf, codec, op=op)
