"""Quantization codecs: the round trip stays within half a step of each element's block."""

from __future__ import annotations

import pytest
import torch

from zero_ray.collective.codecs import BlockQuant, codec


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_blockwise_round_trip_within_half_a_step(bits: int, numel: int) -> None:
    g = torch.Generator().manual_seed(bits + numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    q = BlockQuant(bits, 256)
    wire = torch.empty(q.nbytes(numel), dtype=torch.uint8)
    q.encode(x, wire)
    out = torch.empty(numel)
    q.decode(wire, out)
    err = (out - x).abs()
    assert bool((err <= q.bound(x) * (1 + 1e-6)).all())
    # the block's largest element is exact up to float rounding
    assert float(err.max()) <= float(x.abs().max()) / q.qmax / 2 * (1 + 1e-6)


def test_sizes_on_the_wire() -> None:
    assert BlockQuant(8, 256).nbytes(1000) == 1024 + 4 * 4
    assert BlockQuant(4, 256).nbytes(1000) == 512 + 4 * 4
    assert codec("bf16").nbytes(10) == 20
    assert codec("fp32") is None


def test_int4_uses_the_full_range_and_zero_blocks() -> None:
    q = BlockQuant(4, 4)
    x = torch.tensor([7.0, -7.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    wire = torch.empty(q.nbytes(8), dtype=torch.uint8)
    q.encode(x, wire)
    out = torch.empty(8)
    q.decode(wire, out)
    assert torch.equal(out, x)  # integers within qmax with scale 1, and an all-zero block


def test_bf16_relative_error() -> None:
    x = torch.randn(1000)
    c = codec("bf16")
    wire = torch.empty(c.nbytes(1000), dtype=torch.uint8)
    c.encode(x, wire)
    out = torch.empty(1000)
    c.decode(wire, out)
    assert bool(((out - x).abs() <= x.abs() * 2**-8).all())
