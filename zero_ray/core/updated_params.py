"""Which parameters a step updates, as ``torch.optim`` decides it, across ranks.

``torch.optim`` skips a parameter whose ``.grad`` is None: no weight decay, no moment update,
no step count. In data parallelism a parameter has a gradient when any rank produced one in
any micro-batch (DDP with ``find_unused_parameters`` reduces the others' zeros). So every rank
marks the parameters it saw a gradient for, one small all-reduce sums the marks, and the
optimizer is given ``grad=None`` for the others on every rank (torch keeps each parameter's own
``state["step"]``).

The marks travel as float64 sums (``Collective.all_reduce_values``): a mark is 0 or 1 per rank,
so a sum is at most ``world_size``, and several sums are packed into one float as digits of
base ``world_size + 1`` within its 53-bit mantissa.

The same all-reduce carries everything else the ranks agree on before the update (the squared
shard norms, the items a pair-form loss counted, which ranks saw a non-finite loss or gradient):
``UpdateShare`` is what one rank contributes and ``UpdateSums`` what it reads back, so no caller
slices the packed floats by position.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from zero_ray.errors import ConfigError

_MANTISSA_BITS = 53


def digits_per_value(world_size: int) -> int:
    """How many per-rank 0/1 marks, summed over ``world_size`` ranks, fit in one float64."""
    if world_size < 1:
        raise ConfigError(f"{world_size=} must be at least 1")
    return max(1, int(_MANTISSA_BITS // math.log2(world_size + 1)))


def pack_marks(marks: Sequence[bool], world_size: int) -> list[float]:
    """This rank's marks as floats whose sum over ranks ``unpack_marks`` reads back."""
    per, base = digits_per_value(world_size), world_size + 1
    out: list[float] = []
    for start in range(0, len(marks), per):
        value = 0
        for k, mark in enumerate(marks[start:start + per]):
            value += int(bool(mark)) * base**k
        out.append(float(value))
    return out


def unpack_marks(values: Sequence[float], count: int, world_size: int) -> list[bool]:
    """Whether any rank marked each of ``count`` entries, from the summed packed floats."""
    per, base = digits_per_value(world_size), world_size + 1
    out: list[bool] = []
    for value in values:
        v = int(round(value))
        for _ in range(min(per, count - len(out))):
            v, digit = divmod(v, base)
            out.append(digit > 0)
    if len(out) != count:
        raise ConfigError(f"{len(values)} packed values hold {len(out)} marks, not {count}")
    return out


@dataclass(frozen=True, kw_only=True)
class UpdateSums:
    """What every rank reads back from the step's one all-reduce, the same on each.

    ``squares``: the summed squared norms of the ranks' update slices (None when each rank
    updates the whole buffer and sends none). ``count``: the items a pair-form loss counted
    over every rank (None for a mean loss). ``used``: per mark, whether any rank set it.
    ``loss_ranks`` / ``grad_ranks``: the ranks whose loss / gradient slice was non-finite."""

    squares: float | None
    count: float | None
    used: tuple[bool, ...]
    loss_ranks: tuple[int, ...]
    grad_ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class UpdateShare:
    """One rank's contribution to the step's one all-reduce before the update.

    ``squares``: this rank's squared norm of its update slice, or None when every rank updates
    the whole buffer (the norm needs no sum). ``count``: the items its pair-form loss counted,
    or None for a mean loss. ``marks``: per trainable parameter, whether it saw a gradient.
    ``loss_nonfinite`` / ``grad_nonfinite``: whether its loss / gradient slice was non-finite.

    ``pack`` lays out exactly the floats the engine sent before this record existed, in the
    same order and number: ``[squares] + [count]`` (each only when not None), then
    ``pack_marks(marks)``, then ``pack_marks`` of ``2 * world_size`` flags (the loss flag at
    ``rank``, the gradient flag at ``world_size + rank``). So the collective's traffic and
    sums are bit-identical. Every rank packs the same shape (the presence of ``squares`` and
    ``count`` and the number of marks agree across ranks), which is what lets ``unpack`` read
    the summed values by this rank's own layout."""

    rank: int
    world_size: int
    squares: float | None
    count: float | None
    marks: tuple[bool, ...]
    loss_nonfinite: bool
    grad_nonfinite: bool

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank} must be in [0, world_size={self.world_size})")

    def _head(self) -> list[float]:
        return ([] if self.squares is None else [float(self.squares)]) + \
               ([] if self.count is None else [float(self.count)])

    def _flags(self) -> list[bool]:
        flags = [False] * (2 * self.world_size)
        flags[self.rank] = self.loss_nonfinite
        flags[self.world_size + self.rank] = self.grad_nonfinite
        return flags

    def pack(self) -> list[float]:
        """The floats to sum across ranks (``Collective.all_reduce_values``)."""
        n = self.world_size
        return self._head() + pack_marks(self.marks, n) + pack_marks(self._flags(), n)

    def unpack(self, summed: Sequence[float]) -> UpdateSums:
        """The typed sums from every rank's ``pack()`` summed element-wise."""
        n, head = self.world_size, len(self._head())
        n_marks = len(pack_marks(self.marks, n))
        expected = head + n_marks + len(pack_marks(self._flags(), n))
        if len(summed) != expected:
            raise ConfigError(f"{len(summed)} summed values, but this rank packed {expected}: "
                              "every rank must pack the same squares/count presence and number of marks")
        used = unpack_marks(summed[head:head + n_marks], len(self.marks), n)
        bad = unpack_marks(summed[head + n_marks:], 2 * n, n)
        return UpdateSums(squares=None if self.squares is None else summed[0],
                          count=None if self.count is None else summed[head - 1],
                          used=tuple(used),
                          loss_ranks=tuple(r for r in range(n) if bad[r]),
                          grad_ranks=tuple(r for r in range(n) if bad[n + r]))
