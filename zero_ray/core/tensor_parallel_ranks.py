"""Which ranks form which groups when ``world_size`` owners run tensor parallelism of size T.

The N = T x D ranks form D data-parallel ranks of T tensor-parallel owners each. A TP group is a
run of T consecutive ranks (rank r is TP rank ``r % T`` of data-parallel rank ``r // T``), so
ranks placed in order fill a node with whole groups: the layer's all-reduces, which run on every
layer of every micro-batch, stay inside a node, and only ZeRO's traffic crosses nodes.

Each TP rank's shard of the model is partitioned by ZeRO over its data-parallel group: the D
ranks holding that same shard (TP rank t of every data-parallel rank, strided by T). Every TP
rank of a data-parallel rank reads the same samples: the data rank is the data-parallel rank.

The global gradient norm is one sum over every rank: a sharded parameter's elements are
distinct on every TP rank, a replicated one's (a norm weight, an embedding) are the same on all
T of them and count once (``squares_share``). Stage 0 keeps the whole reduced gradient on each
of the D data-parallel ranks, which count it once between them.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TensorParallelRanks:
    """The groups of ``world_size`` ranks under tensor parallelism of ``size`` (T)."""

    world_size: int
    size: int
    # D: the data-parallel ranks (each a TP group of T owners); a field, as every step reads it
    data_parallel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if self.world_size % self.size:
            low = self.world_size - self.world_size % self.size
            raise ConfigError(f"world_size={self.world_size} is not divisible by tensor_parallel size={self.size}; "
                              f"use a multiple of {self.size} (e.g. {low or self.size} or {low + self.size})")
        object.__setattr__(self, "data_parallel", self.world_size // self.size)  # frozen: set once here

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank} is outside the world of {self.world_size} ranks")

    def tp_rank(self, rank: int) -> int:
        """``rank``'s place in its TP group: which shard of each sharded layer it holds."""
        self._check(rank)
        return rank % self.size

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel rank: its TP group's index, and the data rank it reads as."""
        self._check(rank)
        return rank // self.size

    def tp_members(self, rank: int) -> tuple[int, ...]:
        """World ranks of ``rank``'s TP group, in TP-rank order (consecutive)."""
        start = self.dp_rank(rank) * self.size
        return tuple(range(start, start + self.size))

    def dp_members(self, rank: int) -> tuple[int, ...]:
        """World ranks holding ``rank``'s TP shard, in data-parallel order: the group ZeRO
        partitions that shard's model state over."""
        return tuple(range(self.tp_rank(rank), self.world_size, self.size))

    def squares_share(self, rank: int, *, sharded: float, replicated: float, whole: bool) -> float:
        """What ``rank`` adds to the world's sum of squared gradients: its sharded parameters'
        squares whole and its replicated ones' over T (every TP rank holds them); all of it
        over D where every data-parallel rank holds the whole reduced gradient (``whole``:
        stage 0), since each then has the sum the others have."""
        self._check(rank)
        share = sharded + replicated / self.size
        return share / self.data_parallel if whole else share

    def count_share(self, rank: int, count: float) -> float:
        """What ``rank`` adds to the world's sum of loss items: the TP ranks of one
        data-parallel rank read the same samples, so only TP rank 0 counts them."""
        return count if self.tp_rank(rank) == 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class ShardMoves:
    """TP shard ``shard``'s part of a transfer between two layouts of the same T (a resize of D,
    or a restore from peer snapshots): a transfer plan over data-parallel ranks, carried out
    among the actors that hold or take this shard. ``senders[d]`` is the position of the actor
    holding old data-parallel rank d's state of the shard, ``receivers[j]`` the position taking
    new data-parallel rank j; ``old_ranks[d]`` the old world rank whose state that is."""

    shard: int
    old_ranks: tuple[int, ...]
    senders: tuple[int, ...]
    receivers: tuple[int, ...]


def shard_moves(*, size: int, old_world: int, new_world: int,
                holders: Sequence[int] | None = None) -> tuple[ShardMoves, ...]:
    """Every TP shard's part of a transfer from ``old_world`` to ``new_world`` ranks at T =
    ``size``. ``holders[i]``: the position holding old world rank i's state (a peer's copy after
    a loss); None for a live resize, where actor i holds old rank i. Shard t's old ranks are
    ``t, t + T, ...``, so moves only ever go between owners of one shard: another shard's
    layout has other elements (with T = 1 this is the plain transfer over every rank)."""
    for world in (old_world, new_world):
        TensorParallelRanks(world_size=world, size=size)  # whole TP groups, or a ConfigError naming them
    held = tuple(range(old_world)) if holders is None else tuple(holders)
    if len(held) != old_world:
        raise ConfigError(f"a transfer from {old_world} ranks names {len(held)} holders")
    return tuple(ShardMoves(shard=t, old_ranks=tuple(range(t, old_world, size)),
                            senders=tuple(held[r] for r in range(t, old_world, size)),
                            receivers=tuple(range(t, new_world, size))) for t in range(size))
