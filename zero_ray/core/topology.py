"""Multi-node topology: where each owner runs, and the groups ZeRO shards and communicates in.

``Topology`` is what a user asks for (``ZeroConfig(topology=zr.Topology(...))``); ``plan_mesh``
turns it and the node Ray placed each owner on into a ``Mesh``: the node-major order of the
ranks (positions) and, for any rank, the world ranks of each group it belongs to:

- shard group (size G; MiCS / HSDP): model state is partitioned over its G members and
  replicated across the R = N / G groups. Gradients are reduce-scattered in the group and each
  shard all-reduced across the groups (its *replica* group: the members with the same group rank).
- secondary group (size S, stage 3; ZeRO++'s hpZ): after forward each rank keeps 1/S of every
  gathered unit, so backward's all-gather stays within S ranks (a node).
- inner group (size L): the lower level of the hierarchical gradient reduction. With shard
  groups it is the shard group; otherwise the secondary group, or the node. The upper level
  (the *outer* group, N / L members) is where quantized gradients (qgZ) travel.

Ranks keep the number their owner was started with; the *position* of a rank is its place in
node-major order (nodes by their lowest rank, ranks in order within a node), and every group is a
run of consecutive positions, so a group of a node's size is that node. Integer sizes work on one
node as well (tests exercise them anywhere).

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from zero_ray.errors import ConfigError

WEIGHT_COMM = ("fp32", "bf16", "int8")
GRAD_COMM = ("fp32", "bf16", "int8", "int4")
NODE = "node"

Size = int | Literal["node"] | None


def _check_size(name: str, value: object) -> None:
    if value is None or value == NODE:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer, \"node\" or None")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """How owners are grouped (the default is today's flat ZeRO over every owner).

    shard_group_size: partition model state within groups of this many owners (an int, or
        "node": the owners of one node) and replicate it across groups (MiCS / FSDP2's HSDP).
        None: one group of every owner.
    secondary_group_size: stage 3 only (ZeRO++'s hpZ): after forward each unit keeps a
        secondary partition over groups of this size ("node": a node), so backward's
        all-gather stays within them. Must divide the shard group.
    weight_comm: the dtype of stage 3's forward all-gather: "fp32" (the compute dtype, as
        today), "bf16", or "int8" (blockwise, a scale per block: ZeRO++'s qwZ).
    grad_comm: the dtype of the gradient reduction where it crosses the inner groups (nodes):
        "fp32" (the reduce dtype, as today), "bf16", "int8" or "int4" (blockwise: qgZ). The
        reduction becomes hierarchical: full precision inside the group, quantized across.
    quant_block: elements per quantization block (each with its own fp32 scale).
    """

    shard_group_size: Size = None
    secondary_group_size: Size = None
    weight_comm: str = "fp32"
    grad_comm: str = "fp32"
    quant_block: int = 256

    def __post_init__(self) -> None:
        _check_size("shard_group_size", self.shard_group_size)
        _check_size("secondary_group_size", self.secondary_group_size)
        if self.weight_comm not in WEIGHT_COMM:
            raise ConfigError(f"weight_comm={self.weight_comm!r} is not one of {WEIGHT_COMM}")
        if self.grad_comm not in GRAD_COMM:
            raise ConfigError(f"grad_comm={self.grad_comm!r} is not one of {GRAD_COMM}")
        q = self.quant_block
        if isinstance(q, bool) or not isinstance(q, int) or q < 2 or q % 2:
            raise ConfigError(f"quant_block={q!r} must be an even integer >= 2 (int4 packs two per byte)")
        if (self.shard_group_size == NODE and isinstance(self.secondary_group_size, int)) or \
                (self.secondary_group_size == NODE and isinstance(self.shard_group_size, int)):
            raise ConfigError(f"shard_group_size={self.shard_group_size!r} and secondary_group_size="
                              f"{self.secondary_group_size!r} mix \"node\" with a number; give both as numbers "
                              "or both as \"node\"")
        if isinstance(self.shard_group_size, int) and isinstance(self.secondary_group_size, int) \
                and self.shard_group_size % self.secondary_group_size:
            raise ConfigError(f"secondary_group_size={self.secondary_group_size} must divide "
                              f"shard_group_size={self.shard_group_size}: backward gathers within the shard group")

    @property
    def flat(self) -> bool:
        """Today's ZeRO: one group, no secondary partition, full-precision collectives."""
        return (self.shard_group_size is None and self.secondary_group_size is None
                and self.weight_comm == "fp32" and self.grad_comm == "fp32")

    def math_record(self) -> dict[str, object]:
        """What of the topology changes what a step computes, as JSON data (checkpoints record it
        among the training configuration): the dtypes of the collectives, and the block of an
        integer code. Shard groups and hpZ move the same sums in full precision (replicas end
        every step with identical bits), so their sizes are not recorded."""
        integer = {self.weight_comm, self.grad_comm} & {"int8", "int4"}
        return {"weight_comm": self.weight_comm, "grad_comm": self.grad_comm,
                "quant_block": self.quant_block if integer else None}

    @classmethod
    def from_math_record(cls, record: dict[str, object]) -> Topology:
        """A flat topology with the recorded collectives' dtypes (``math_record``'s inverse)."""
        fields = {k: v for k, v in record.items() if k in ("weight_comm", "grad_comm", "quant_block") and v is not None}
        return cls(**fields)  # type: ignore[arg-type]

    def check_resize(self, old: int, new: int) -> None:
        """Refuse a resize from ``old`` to ``new`` owners that would break a group: with shard
        groups or hpZ the new size must be a multiple of each integer group size (shard groups
        are added or let go whole, ``driver/replica_restore.py``); a ``"node"`` size follows where
        Ray places the new owners, so such a run keeps its size."""
        if new == old:
            return
        for name in ("shard_group_size", "secondary_group_size"):
            size = getattr(self, name)
            if size == "node":
                raise ConfigError(f"resize from {old} to {new} owners with {name}='node' is not supported: the "
                                  "groups would follow where Ray places new owners; give the size as an integer")
            if isinstance(size, int) and new % size:
                raise ConfigError(f"resize to {new} owners would break the groups of {name}={size}: resize to a "
                                  f"multiple of {size}")

    def resize_multiple(self) -> int | None:
        """What every size a resize goes to must be a multiple of: the least common multiple of
        the integer group sizes (1 when flat); None when a group size is ``"node"``."""
        sizes = [self.shard_group_size, self.secondary_group_size]
        if "node" in sizes:
            return None
        return math.lcm(*(s for s in sizes if isinstance(s, int)))

    def check_stage(self, stage: int) -> None:
        """Refuse options the stage has no use for (hpZ and qwZ act on stage 3's gathers)."""
        if stage != 3 and self.secondary_group_size is not None:
            raise ConfigError(f"secondary_group_size={self.secondary_group_size!r} (hpZ) needs stage=3, not "
                              f"{stage}: only stage 3 gathers parameters for backward")
        if stage != 3 and self.weight_comm != "fp32":
            raise ConfigError(f"weight_comm={self.weight_comm!r} (qwZ) needs stage=3, not {stage}: it is the dtype "
                              "of stage 3's forward all-gather")


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Every owner's position and groups, the same on every rank (see the module docstring)."""

    nodes: tuple[str, ...]  # the node of each world rank
    order: tuple[int, ...]  # position -> world rank (node-major)
    shard: int  # G: owners a partition is spread over
    secondary: int | None  # S: hpZ's secondary group, or None
    inner: int  # L: the lower level of the gradient reduction
    node_size: int  # owners per node (equal on every node), or 0 when they differ

    @property
    def world_size(self) -> int:
        return len(self.order)

    @property
    def replicas(self) -> int:
        """R: how many groups hold a copy of each shard."""
        return self.world_size // self.shard

    @property
    def outer(self) -> int:
        """Members of the upper level of the gradient reduction (N / L)."""
        return self.world_size // self.inner

    @property
    def node_count(self) -> int:
        return len(set(self.nodes))

    def position(self, rank: int) -> int:
        return self.order.index(rank)

    def _run(self, rank: int, size: int) -> tuple[int, ...]:
        start = self.position(rank) // size * size
        return self.order[start:start + size]

    def _strided(self, rank: int, size: int) -> tuple[int, ...]:
        """The ranks at the same place of every run of ``size`` positions."""
        offset = self.position(rank) % size
        return self.order[offset::size]

    def shard_members(self, rank: int) -> tuple[int, ...]:
        """World ranks of ``rank``'s shard group, in group-rank order."""
        return self._run(rank, self.shard)

    def replica_members(self, rank: int) -> tuple[int, ...]:
        """World ranks holding the same shard as ``rank`` (one per shard group), in group order."""
        return self._strided(rank, self.shard)

    def secondary_members(self, rank: int) -> tuple[int, ...]:
        if self.secondary is None:
            raise ConfigError("this mesh has no secondary group (secondary_group_size=None)")
        return self._run(rank, self.secondary)

    def inner_members(self, rank: int) -> tuple[int, ...]:
        return self._run(rank, self.inner)

    def outer_members(self, rank: int) -> tuple[int, ...]:
        return self._strided(rank, self.inner)

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def save_role(self, rank: int) -> SaveRole:
        """What ``rank`` writes in a checkpoint: the state is laid out over the G members of a
        shard group, the same as a flat run of G owners, and every shard group holds a copy; so
        the first shard group (positions 0..G-1) writes the G rank files, as ranks 0..G-1 of G,
        and the other groups write nothing (each element once)."""
        position = self.position(rank)
        return SaveRole(writes=position < self.shard, rank=position % self.shard, world_size=self.shard)


@dataclass(frozen=True, kw_only=True)
class SaveRole:
    """A rank's part in a checkpoint (``Mesh.save_role``): whether it writes a file, and the rank
    and world size of the flat layout its file belongs to (its shard group's)."""

    writes: bool
    rank: int
    world_size: int


def node_major(nodes: Sequence[str]) -> tuple[int, ...]:
    """World ranks in node-major order: nodes by their lowest rank, ranks ascending within one."""
    first: dict[str, int] = {}
    for r, n in enumerate(nodes):
        first.setdefault(n, r)
    return tuple(sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r)))


def _node_size(nodes: Sequence[str]) -> int:
    counts = {n: nodes.count(n) for n in set(nodes)}
    sizes = set(counts.values())
    return sizes.pop() if len(sizes) == 1 else 0


def _resolve(name: str, value: Size, *, world: int, node_size: int, nodes: Sequence[str]) -> int | None:
    if value is None:
        return None
    if value == NODE:
        if not node_size:
            counts = {n: list(nodes).count(n) for n in dict.fromkeys(nodes)}
            raise ConfigError(f"{name}=\"node\" needs the same number of owners on every node; Ray placed them "
                              f"{sorted(counts.values())} per node. Give an integer size, or place the owners "
                              "evenly (placement_strategy, resources per node)")
        return node_size
    assert isinstance(value, int)
    if world % value:
        raise ConfigError(f"{name}={value} does not divide world_size={world}; choose a divisor of the world size")
    return value


def plan_mesh(topology: Topology, nodes: Sequence[str]) -> Mesh:
    """The mesh of ``len(nodes)`` owners, rank r on ``nodes[r]``."""
    world = len(nodes)
    if world < 1:
        raise ConfigError("a mesh needs at least one owner")
    size = _node_size(nodes)
    shard = _resolve("shard_group_size", topology.shard_group_size, world=world, node_size=size, nodes=nodes)
    secondary = _resolve("secondary_group_size", topology.secondary_group_size, world=world, node_size=size,
                         nodes=nodes)
    g = shard if shard is not None else world
    if g == 1 and world > 1:
        raise ConfigError("shard_group_size=1 partitions nothing: every owner holds everything. For plain data "
                          "parallelism use stage 0 (shard_group_size=None)")
    if secondary is not None and g % secondary:
        raise ConfigError(f"secondary_group_size={secondary} must divide the shard group's {g} owners")
    if shard is not None and shard < world:
        inner = shard
    elif secondary is not None:
        inner = secondary
    elif topology.grad_comm != "fp32" and size:
        inner = size  # quantized where the reduction leaves the node
    else:
        inner = world
    return Mesh(nodes=tuple(nodes), order=node_major(nodes), shard=g, secondary=secondary, inner=inner,
                node_size=size)
