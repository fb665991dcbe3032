"""Every (saving layout, N) x (loading layout, M) for N, M in 1..4, without Ray: the ranges each
new rank updates are read back exactly, whatever buckets and shard boundaries the saving run
had. Stages 1-2 lay out buckets by size; stage 3 one bucket per unit; stage 0 updates whole
buckets (every element on every rank)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from checkpoint_builders import ADAM, save
from zero_ray.checkpoint.format import MASTER
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.models import mlp

MODULE = mlp(8, 3)  # 6 parameters: 3 x (weight 8x8, bias 8)
SPECS = [(n, tuple(p.shape), "float32") for n, p in MODULE.named_parameters()]
LAYOUTS = {
    "by_size": lambda n: FlatLayout.by_size(SPECS, world_size=n, bucket_numel=50),  # stages 0-2
    "units": lambda n: FlatLayout.build(SPECS, world_size=n, groups=[[0, 1], [2, 3], [4, 5]]),  # stage 3
}


@pytest.mark.parametrize("saved_as,n", list(itertools.product(LAYOUTS, range(1, 5))))
def test_any_layout_reads_back_from_any_other(saved_as: str, n: int, tmp_path: Path) -> None:
    groups = [list(b.params) for b in LAYOUTS[saved_as](n).buckets]
    saved = save(MODULE, tmp_path, world_size=n, groups=groups)
    reader = CheckpointReader(saved.path)
    for (load_as, m), whole in itertools.product(itertools.product(LAYOUTS, range(1, 5)), (False, True)):
        layout = LAYOUTS[load_as](m)
        for rank in range(m):
            for b in layout.buckets:
                lo, hi = (0, b.padded_numel) if whole else b.shard_range(rank)
                for f in layout.fragments(b.index, lo, hi):
                    name = layout.params[f.param].name
                    for kind in (MASTER, *ADAM):
                        got = reader.read(kind, name, f.param_start, f.param_end)
                        assert torch.equal(got, saved.values[(kind, name)][f.param_start:f.param_end]), \
                            (saved_as, n, load_as, m, rank, name, kind)
