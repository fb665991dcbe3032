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

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
