"""The step's one all-reduce before the update as typed records (``UpdateShare`` ->
``UpdateSums``): several ranks pack, the floats are summed element-wise as the all-reduce
does, and every rank reads back the same sums. Pure, milliseconds."""

from __future__ import annotations

import math

import pytest

from zero_ray.core.updated_params import UpdateShare, UpdateSums, digits_per_value, pack_marks
from zero_ray.errors import ConfigError


def _all_reduce(shares: list[UpdateShare]) -> list[float]:
    packed = [s.pack() for s in shares]
    assert len({len(p) for p in packed}) == 1  # every rank sends the same number of floats
    return [math.fsum(col) for col in zip(*packed)]


def _shares(world_size: int, n_marks: int, *, squares: list[float] | None, counts: list[float] | None,
            bad_loss: set[int] = frozenset(), bad_grad: set[int] = frozenset()) -> list[UpdateShare]:
    return [UpdateShare(rank=r, world_size=world_size,
                        squares=None if squares is None else squares[r],
                        count=None if counts is None else counts[r],
                        marks=tuple((r * 5 + k * 3) % 7 == 0 for k in range(n_marks)),
                        loss_nonfinite=r in bad_loss, grad_nonfinite=r in bad_grad)
            for r in range(world_size)]


def test_sharded_counted_step_sums_squares_and_counts_and_ors_the_marks() -> None:
    n, n_marks = 3, 2 * digits_per_value(3) + 5  # marks over several packed floats
    shares = _shares(n, n_marks, squares=[1.5, 2.25, 4.0], counts=[10.0, 7.0, 0.0])
    summed = _all_reduce(shares)
    expected = UpdateSums(squares=7.75, count=17.0,
                          used=tuple(any(col) for col in zip(*(s.marks for s in shares))),
                          loss_ranks=(), grad_ranks=())
    assert all(s.unpack(summed) == expected for s in shares)  # every rank reads the same sums
    assert any(expected.used) and not all(expected.used)  # the OR is not trivially all or none
    # a mark one rank alone set survives the sum
    only_rank_1 = [k for k in range(n_marks) if shares[1].marks[k] and not shares[0].marks[k]
                   and not shares[2].marks[k]]
    assert only_rank_1 and all(expected.used[k] for k in only_rank_1)


def test_the_ranks_with_a_nonfinite_loss_or_gradient_are_named() -> None:
    n = 4
    shares = _shares(n, 9, squares=[1.0, math.inf, 2.0, 3.0], counts=None, bad_loss={2}, bad_grad={1, 3})
    sums = shares[0].unpack(_all_reduce(shares))
    assert (sums.loss_ranks, sums.grad_ranks) == ((2,), (1, 3))
    assert sums.squares == math.inf and sums.count is None


def test_whole_buffer_mean_loss_sends_only_marks_and_flags() -> None:
    n = 2
    shares = _shares(n, 4, squares=None, counts=None, bad_loss={0})
    sums = shares[1].unpack(_all_reduce(shares))
    assert sums.squares is None and sums.count is None
    assert (sums.loss_ranks, sums.grad_ranks) == ((0,), ())
    assert len(shares[0].pack()) == 2  # four marks in one float, four flags in another


def test_pack_lays_out_the_floats_the_engine_sent_before() -> None:
    # [squares, count] + pack_marks(marks) + pack_marks(2n flags): same order, same length
    n, marks = 3, (True, False, True, True)
    share = UpdateShare(rank=1, world_size=n, squares=2.5, count=12.0, marks=marks,
                        loss_nonfinite=True, grad_nonfinite=False)
    flags = [False, True, False, False, False, False]
    assert share.pack() == [2.5, 12.0] + pack_marks(list(marks), n) + pack_marks(flags, n)
    counted_only = UpdateShare(rank=2, world_size=n, squares=None, count=3.0, marks=marks,
                               loss_nonfinite=False, grad_nonfinite=True)
    flags = [False, False, False, False, False, True]
    assert counted_only.pack() == [3.0] + pack_marks(list(marks), n) + pack_marks(flags, n)
    assert counted_only.unpack(counted_only.pack()).count == 3.0


def test_refuses_a_bad_rank_and_sums_of_another_shape() -> None:
    with pytest.raises(ConfigError, match="rank=2"):
        UpdateShare(rank=2, world_size=2, squares=None, count=None, marks=(), loss_nonfinite=False,
                    grad_nonfinite=False)
    share = UpdateShare(rank=0, world_size=2, squares=1.0, count=None, marks=(True,),
                        loss_nonfinite=False, grad_nonfinite=False)
    with pytest.raises(ConfigError, match="2 summed values, but this rank packed 3"):
        share.unpack([1.0, 1.0])
