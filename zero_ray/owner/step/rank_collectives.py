"""Fabric: how one rank's collectives are arranged under the run's ``Topology``.

From the node of every rank (``nodes``; the actor learns them from Ray, thread ranks are told)
``core.topology.plan_mesh`` gives the mesh, and the fabric builds what the model state uses:

- ``primary``: the Collective the model state is sharded over. For the default (flat) topology
  it is the world group itself, so today's ZeRO runs bit for bit as before; otherwise a
  ``MeshGroup`` (shard group, replicas, hierarchical and quantized gradients).
- ``secondary``: hpZ's secondary group. After each forward gather of a unit, every rank keeps its
  1/S of the gathered parameters (``keep``), and backward's gather fills the unit from those
  copies within S ranks (a node) instead of from the shards across the whole shard group.
- ``weight_codec``: qwZ: stage 3's forward all-gather sends blockwise int8 (or bf16).
- ``tensor``: with tensor parallelism (``TensorParallel(size=T)``, T > 1), the rank's TP group
  (the layers' all-reduces); ``primary`` is then its data-parallel group, the D ranks holding the
  same TP shard (``core/tensor_parallel_ranks.py``), whose step scalars still span the world.

It also says which bytes stayed inside a node (``split``): every message is counted by the world
rank it went to.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from zero_ray.collective.codecs import Codec, codec
from zero_ray.collective.collective_api import Collective
from zero_ray.collective.mesh_group import MeshGroup
from zero_ray.collective.stream import CommStream
from zero_ray.collective.subgroup import SubGroup
from zero_ray.core.group_policy import ParamResidency
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.tensor_parallel_ranks import TensorParallelRanks
from zero_ray.core.topology import Mesh, SaveRole, Topology, plan_mesh
from zero_ray.errors import ConfigError
from zero_ray.owner.tensors.accounting import StateCounter
from zero_ray.owner.step.param_group import ParamGroup

LOCAL_NODE = "local"


def exchange_nodes(world: Collective, node: str) -> list[str]:
    """The node of every rank of ``world`` (this one is on ``node``), in one scalar all-reduce:
    each rank puts a 32-bit digest of its node id in its own slot (exact in float64)."""
    if world.world_size == 1:
        return [node]
    values = [0.0] * world.world_size
    values[world.rank] = float(zlib.crc32(node.encode()))
    return [f"node-{int(v):08x}" for v in world.all_reduce_values(values)]


class Fabric:
    """One rank's groups and codecs (see the module docstring)."""

    def __init__(self, topology: Topology, world: Collective, nodes: Sequence[str] | None = None, *,
                 tensor_parallel: TensorParallel | None = None) -> None:
        self.topology = topology
        self.world = world
        self.tensor_parallel = tensor_parallel or TensorParallel()
        self.mesh: Mesh = plan_mesh(topology, list(nodes) if nodes is not None else [LOCAL_NODE] * world.world_size)
        self.replicas: int = self.mesh.replicas  # R: fixed for this arrangement, read by every step
        block = topology.quant_block
        self.primary: Collective = (world if topology.flat else
                                    MeshGroup(world, self.mesh, grad_codec=codec(topology.grad_comm, block=block)))
        me = world.rank
        self.ranks = TensorParallelRanks(world_size=world.world_size, size=self.tensor_parallel.size)
        self.tensor: SubGroup | None = None
        if self.ranks.size > 1:
            if not topology.flat:
                raise ConfigError(f"tensor parallelism (size={self.ranks.size}) with {topology} is not built yet: "
                                  "shard groups, hpZ and quantized collectives inside the data-parallel group come "
                                  "later (docs/tensor_parallel.md); use zr.Topology() with tensor_parallel")
            # its bytes counted as "tp_*", apart from ZeRO's (comm_report's TP / DP split)
            self.tensor = SubGroup(world, self.ranks.tp_members(me), me=me, label="tp_")
            self.primary = SubGroup(world, self.ranks.dp_members(me), me=me, scalars=world)
        self.secondary: SubGroup | None = None
        if self.mesh.secondary is not None:
            self.secondary = SubGroup(world, self.mesh.secondary_members(world.rank), me=world.rank)
        # What this rank writes in a checkpoint (flat: its own file, by world rank, as always).
        self.save_role: SaveRole = (SaveRole(writes=True, rank=world.rank, world_size=world.world_size)
                                    if topology.flat else self.mesh.save_role(world.rank))
        self.weight_codec: Codec | None = codec(topology.weight_comm, block=block)
        self._copies: dict[int, torch.Tensor] = {}  # hpZ: group index -> this rank's secondary slice
        self._kept: set[int] = set()  # groups whose copy holds this step's parameters

    @property
    def data_rank(self) -> int:
        """The rank whose samples this rank reads: its data-parallel rank (every TP rank of one
        reads the same samples); the world rank without tensor parallelism."""
        return self.ranks.dp_rank(self.world.rank)

    @property
    def data_world_size(self) -> int:
        """How many ranks the global batch is split over (D)."""
        return self.ranks.data_parallel

    def rebind(self, world: Collective) -> Fabric:
        """The same arrangement over a re-formed world group (copies dropped)."""
        return Fabric(self.topology, world, self.mesh.nodes, tensor_parallel=self.tensor_parallel)

    # -- hpZ's secondary partition ------------------------------------------------------------------
    def allocate(self, groups: Sequence[ParamGroup]) -> None:
        """Allocate the secondary slices of every group gathered per use (held for the run, as
        ZeRO++ does: counted by ``memory_report``)."""
        if self.secondary is None:
            return
        s = self.secondary.world_size
        for g in groups:
            if g.policy.params is ParamResidency.PER_USE:
                self._copies[g.index] = torch.zeros(g.bucket.padded_numel // s, dtype=g.dtype, device=g.master.device)

    def forget(self) -> None:
        """The parameters are about to change or be gathered afresh: the copies are stale."""
        self._kept.clear()

    def gather(self, g: ParamGroup, region: torch.Tensor, stream: CommStream, *, backward: bool, op: str) -> None:
        """Fill ``region`` with ``g``'s whole parameters (on the stream's thread): backward from
        the secondary copies where they hold this step's values, forward with the weight codec."""
        full = region[:g.bucket.padded_numel]
        copy = self._copies.get(g.index)
        if backward and copy is not None and g.index in self._kept:
            assert self.secondary is not None
            full.view(self.secondary.world_size, -1)[self.secondary.rank].copy_(copy)
            self.secondary.all_gather_(full, op=op + "_secondary")
            return
        if not backward and self.weight_codec is not None and isinstance(self.primary, MeshGroup):
            assert g.shard is not None
            full[g.shard_start:g.shard_end].copy_(g.shard)
            self.primary.all_gather_coded_(full, self.weight_codec, op=op)
        else:
            g.gather_into(region, stream, op=op)
        if copy is not None:
            assert self.secondary is not None
            copy.copy_(full.view(self.secondary.world_size, -1)[self.secondary.rank])
            self._kept.add(g.index)

    def count(self, counter: StateCounter) -> None:
        for t in self._copies.values():
            counter.add_whole("params_secondary", t)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._copies.values())

    # -- reports --------------------------------------------------------------------------------------
    def split(self, by_peer: dict[int, int]) -> dict[str, int]:
        """Bytes sent to owners on this rank's node and to owners on others."""
        me = self.world.rank
        inside = sum(n for peer, n in by_peer.items() if self.mesh.same_node(me, peer))
        return {"inside_node": inside, "cross_node": sum(by_peer.values()) - inside}
