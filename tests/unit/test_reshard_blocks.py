"""Blocks of a tensor (TP slices, pure): a block's flat range as runs of the whole tensor, and
what a range of one block reads from a range of another, checked element by element against a
brute-force index map for every pair of TP sizes 1, 2, 3, 4 (colwise: rows; rowwise: columns)."""

from __future__ import annotations

import itertools
import math

import pytest

from zero_ray.core.reshard_plan import Block, overlaps, runs, span
from zero_ray.errors import ConfigError

FULL = (12, 8)  # a weight: 12 output features, 8 input features


def tp_block(full: tuple[int, ...], dim: int, size: int, rank: int) -> Block:
    """TP rank ``rank`` of ``size``'s slice along ``dim`` (torch.chunk with equal parts)."""
    part = full[dim] // size
    offsets = tuple(rank * part if d == dim else 0 for d in range(len(full)))
    extent = tuple(part if d == dim else n for d, n in enumerate(full))
    return Block(full=full, offsets=offsets, extent=extent)


def whole_index(block: Block) -> list[int]:
    """Brute force: the whole tensor's flat index of each of the block's elements, row-major."""
    strides = [math.prod(block.full[d + 1:]) for d in range(len(block.full))]
    return [sum((o + i) * s for o, i, s in zip(block.offsets, idx, strides))
            for idx in itertools.product(*(range(e) for e in block.extent))]


BLOCKS = [Block.whole(FULL)] + [tp_block(FULL, dim, size, rank) for dim in (0, 1) for size in (2, 4)
                                for rank in range(size)] + [tp_block((12,), 0, 3, 1), tp_block((2, 6, 4), 1, 3, 2)]


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_runs_map_every_element_to_its_place_in_the_whole_tensor(block: Block) -> None:
    want = whole_index(block)
    for start, end in [(0, block.numel), (1, block.numel - 1), (3, 4), (2, 2)]:
        got = [w + k for b, w, n in runs(block, start, end) for k in range(n)]
        assert got == want[start:end]
        assert [b for b, _, _ in runs(block, start, end)] == sorted(b for b, _, _ in runs(block, start, end))


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_span_bounds_exactly_the_elements_a_range_covers(block: Block) -> None:
    index = whole_index(block)
    for start, end in [(0, block.numel), (1, block.numel - 1), (block.numel - 1, block.numel)]:
        assert span(block, start, end) == (min(index[start:end]), max(index[start:end]) + 1)


def test_a_rowwise_slice_is_one_run_per_row_and_a_colwise_slice_one_run() -> None:
    assert runs(tp_block(FULL, 0, 2, 1), 0, 48) == [(0, 48, 48)]
    assert runs(tp_block(FULL, 1, 2, 1), 0, 48) == [(4 * r, 8 * r + 4, 4) for r in range(12)]


def layouts(full: tuple[int, ...], dim: int) -> dict[int, list[tuple[Block, tuple[int, int]]]]:
    """Per TP size, each TP rank's slice cut further into two flat ranges (ZeRO over D = 2)."""
    out = {}
    for size in (1, 2, 3, 4):
        if full[dim] % size:
            continue
        pieces = []
        for rank in range(size):
            b = tp_block(full, dim, size, rank)
            half = b.numel // 2 + 1
            pieces += [(b, (0, half)), (b, (half, b.numel))]
        out[size] = pieces
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_any_tp_size_reads_back_from_any_other_exactly(dim: int) -> None:
    full = FULL
    values = list(range(math.prod(full)))  # element i of the whole tensor holds i
    by_size = layouts(full, dim)
    for (saved, saved_pieces), (load, load_pieces) in itertools.product(by_size.items(), by_size.items()):
        stored = [[values[w] for w in whole_index(b)[lo:hi]] for b, (lo, hi) in saved_pieces]
        for want, (lo, hi) in load_pieces:
            out: list[int | None] = [None] * (hi - lo)
            for (have, have_range), data in zip(saved_pieces, stored):
                for dest, src, n in overlaps(want, (lo, hi), have, have_range):
                    assert all(x is None for x in out[dest:dest + n]), "an element read twice"
                    out[dest:dest + n] = data[src:src + n]
            assert out == [values[w] for w in whole_index(want)[lo:hi]], (saved, load)


def test_matching_slices_read_as_one_piece() -> None:
    # the same rowwise slice saved and loaded: contiguous on both sides, so one piece, not a row each
    b = tp_block(FULL, 1, 2, 0)
    assert overlaps(b, (0, b.numel), b, (0, b.numel)) == [(0, 0, b.numel)]
    # a whole tensor from the rowwise halves: a row's half at a time, alternating sources
    assert overlaps(Block.whole(FULL), (0, 96), b, (0, 48))[:2] == [(0, 0, 4), (8, 4, 4)]


def test_a_block_outside_its_tensor_is_refused() -> None:
    with pytest.raises(ConfigError, match="leave the tensor of shape"):
        Block(full=(4, 4), offsets=(2, 0), extent=(3, 4))
    with pytest.raises(ConfigError, match="do not overlap"):
        overlaps(Block.whole((4,)), (0, 4), Block.whole((5,)), (0, 5))
