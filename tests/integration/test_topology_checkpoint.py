"""Checkpoints of a run with shard groups on Ray actors: the first shard group writes the state
once, laid out as a flat run of G owners, and it loads into any topology and world size (each
owner reads the ranges its layout needs, as from a flat checkpoint), continuing as the single
process does."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import zero_ray as zr
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS, SAVE_AT, BATCH = 4, 2, 12
GPT_FN = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
UNITS = zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0))


def config(world_size: int, topology: zr.Topology) -> zr.ZeroConfig:
    return zr.ZeroConfig(stage=3, world_size=world_size, bucket_bytes=4096, topology=topology, stage3=UNITS)


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_shard_group_checkpoint_loads_into_any_topology(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, 64, (BATCH, 17), generator=g) for _ in range(STEPS)]
    opt = zr.AdamW(lr=1e-3, weight_decay=0.01)
    groups = zr.Topology(shard_group_size=2)
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=opt, config=config(4, groups)) as trainer:
        for b in batches[:SAVE_AT]:
            trainer.step(b)
        path = trainer.save_checkpoint(tmp_path)
        for b in batches[SAVE_AT:]:
            trainer.step(b)
        assert trainer.wait_for_checkpoint() == path
        uninterrupted = trainer.full_state_dict()
    m = CheckpointReader(path).manifest
    # Written once, by the first shard group: the partitioning of a flat run of 2 owners.
    assert m.world_size == 2 and [f.name for f in m.files] == ["rank-00000-of-00002.safetensors",
                                                               "rank-00001-of-00002.safetensors"]
    reference, _ = single_process(GPT_FN, lm_loss, opt, batches)
    results = {}
    for name, world, topology in (("flat x3", 3, zr.Topology()), ("groups of 2 x4", 4, groups)):
        with zr.ZeroTrainer.from_checkpoint(path, GPT_FN, lm_loss, config=config(world, topology)) as resumed:
            assert resumed.step_count == SAVE_AT
            for b in batches[SAVE_AT:]:
                resumed.step(b)
            results[name] = resumed.full_state_dict()
        print(f"{name}: {max_dev(results[name], reference):.2e} from one process, "
              f"{max_dev(results[name], uninterrupted):.2e} from the uninterrupted run")
    assert max_dev(uninterrupted, reference) <= 1e-5
    for got in results.values():
        assert max_dev(got, reference) <= 1e-5
    assert max_dev(results["groups of 2 x4"], uninterrupted) == 0.0  # the same layout: bit for bit
