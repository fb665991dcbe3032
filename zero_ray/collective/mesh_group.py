"""MeshGroup: the two-level collectives of a ``Mesh`` under the ``Collective`` protocol.

To the model state a MeshGroup is the rank's shard group: ``rank`` is the group rank and
``world_size`` the group's size G, so buckets are split into G shards and a rank's shard range is
that of its group rank. Under that:

- ``reduce_scatter_``: gradients are reduce-scattered in the shard group, then the shard is
  all-reduced across the R groups that hold it (``grad_codec`` on that hop: qgZ). With one group
  (R = 1) and a codec, the reduction is hierarchical instead: reduce-scattered inside the inner
  group (a node) in full precision, then across the inner groups, encoded.
- ``all_gather_``: within the shard group (``all_gather_coded_`` with qwZ's codec).
- ``all_reduce_`` (stage 0): the two of them.
- ``all_reduce_values``: over every rank of the world (norms, marks, counts).

Every message goes through the world group, which counts it by the world rank it went to.
Where the mesh is one group in rank order and nothing is encoded, each collective is the world
group's own (``RingGroup``'s direct sends included): bit for bit today's flat ZeRO.
"""

from __future__ import annotations

import torch

from zero_ray.collective.codecs import Codec
from zero_ray.collective.collective_api import ByteCounters, Collective, chunks
from zero_ray.collective.subgroup import SubGroup
from zero_ray.core.topology import Mesh


class MeshGroup:
    """One rank's shard group, replica group and inner / outer groups over the world group."""

    def __init__(self, world: Collective, mesh: Mesh, *, grad_codec: Codec | None = None) -> None:
        me = world.rank
        self.world = world
        self.mesh = mesh
        self.grad_codec = grad_codec
        self.counters: ByteCounters = world.counters
        self.shard = SubGroup(world, mesh.shard_members(me), me=me)
        self.replica = SubGroup(world, mesh.replica_members(me), me=me)
        self.rank = self.shard.rank
        self.world_size = self.shard.world_size
        # The world's own collectives serve the shard group when it is the world in rank order.
        self._native = mesh.replicas == 1 and mesh.order == tuple(range(mesh.world_size))
        self.hierarchical = mesh.replicas == 1 and grad_codec is not None and mesh.outer > 1
        self.inner = SubGroup(world, mesh.inner_members(me), me=me)
        self.outer = SubGroup(world, mesh.outer_members(me), me=me)
        # staging of its own: the subgroups' scratch buffers are their rings' receive buffers
        self._staging: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _stage(self, what: str, numel: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        s = self._staging.get((what, dtype))
        if s is None or s.numel() < numel:
            s = self._staging[(what, dtype)] = torch.empty(numel, dtype=dtype, device=like.device)
        return s[:numel]

    @property
    def replicas(self) -> int:
        return self.mesh.replicas

    # -- gradients ------------------------------------------------------------------------------
    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        if self.hierarchical:
            return self._hierarchical(buf, op=op)
        part = self.world.reduce_scatter_(buf, op=op) if self._native else self.shard.reduce_scatter_(buf, op=op)
        if self.replica.world_size > 1:
            self._across_replicas(part, op=op)
        return part

    def _across_replicas(self, part: torch.Tensor, *, op: str) -> None:
        """All-reduce this rank's shard over the groups holding it (padded to split evenly)."""
        r = self.replica.world_size
        padded = -(-part.numel() // r) * r
        scratch = self._stage("replica", padded, part, torch.float32 if self.grad_codec else part.dtype)
        scratch[:part.numel()].copy_(part)
        scratch[part.numel():].zero_()
        if self.grad_codec is not None:
            self.replica.all_reduce_coded_(scratch, self.grad_codec, op=op + "_across")
        else:
            self.replica.all_reduce_(scratch, op=op + "_across")
        part.copy_(scratch[:part.numel()])

    def _hierarchical(self, buf: torch.Tensor, *, op: str) -> torch.Tensor:
        """One group of N positions p = k L + l (K inner groups of L): first inside the inner
        group, member l collects the sum of chunks {k L + l}; then across the inner groups,
        encoded, member k of those gets chunk k L + l: its own."""
        assert self.grad_codec is not None
        n, inner, outer = self.world_size, self.inner.world_size, self.outer.world_size
        parts = chunks(buf, n)
        c = parts[0].numel()
        staged = self._stage("inner", n * c, buf, buf.dtype).view(inner, outer, c)
        staged.copy_(buf.view(outer, inner, c).transpose(0, 1))
        mine = self.inner.reduce_scatter_(staged.view(-1), op=op).view(outer, c)
        wire = self._stage("outer", outer * c, buf, torch.float32)
        wire.copy_(mine.view(-1))
        got = self.outer.reduce_scatter_coded_(wire, self.grad_codec, op=op + "_across")
        out = parts[self.rank]
        out.copy_(got)
        return out

    def all_reduce_(self, buf: torch.Tensor) -> None:
        self.reduce_scatter_(buf, op="all_reduce")
        self.all_gather_(buf, op="all_reduce")

    # -- parameters -----------------------------------------------------------------------------
    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        if self._native:
            self.world.all_gather_(buf, op=op)
        else:
            self.shard.all_gather_(buf, op=op)

    def all_gather_coded_(self, buf: torch.Tensor, codec: Codec, *, op: str) -> None:
        self.shard.all_gather_coded_(buf, codec, op=op)

    # -- the rest of the protocol ---------------------------------------------------------------------
    def all_reduce_values(self, values: list[float]) -> list[float]:
        return self.world.all_reduce_values(values)

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        self.shard.send_recv(sends, recvs, op=op)

    def barrier(self) -> None:
        self.world.barrier()

    def destroy(self) -> None:
        self.world.destroy()

    def abort(self) -> None:
        self.world.abort()
