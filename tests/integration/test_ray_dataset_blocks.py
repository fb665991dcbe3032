"""A Ray Dataset of many blocks is scanned from Ray Data's own block metadata: its fit starts no
more Ray worker processes than the cluster has CPUs (one zero-CPU task per block once started
dozens) and trains as one process fed the documented order; blocks Ray Data holds as pandas, or
hands out as a slice, read as the rows the dataset has."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import ray
import ray.data
import torch

import zero_ray as zr
from benchmarks.harness.ray_workers import workers_started
from fit_order import reference_block_indices
from zero_ray.data.raydata import RayDataset, RayDatasetLayout
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
GPT_FN = functools.partial(GPT, CFG)
SEQ, BATCH, SEED, STEPS, BLOCKS = 8, 6, 5, 6, 2000
OPT = zr.SGD(lr=0.1, momentum=0.9)


def rows_loss(module: torch.nn.Module, batch: dict) -> torch.Tensor:  # type: ignore[type-arg]
    return lm_loss(module, batch["tokens"])


def test_a_2000_block_dataset_fits_with_no_worker_beyond_the_cpus() -> None:
    rng = np.random.default_rng(4)
    rows = rng.integers(0, CFG.vocab_size, size=(BLOCKS, SEQ + 1))
    ds = ray.data.from_items([{"tokens": r.tolist()} for r in rows], override_num_blocks=BLOCKS)
    order = reference_block_indices([1] * BLOCKS, global_batch_size=BATCH, steps=STEPS, seed=SEED, window=4)
    ref, _ = single_process(GPT_FN, lm_loss, OPT, [torch.tensor(rows[idx]) for idx in order])
    cpus = int(ray.cluster_resources()["CPU"])
    with workers_started() as new:
        with zr.ZeroTrainer(GPT_FN, rows_loss, optimizer=OPT,
                            config=zr.ZeroConfig(stage=2, world_size=2, bucket_bytes=4096)) as trainer:
            result = trainer.fit(ds, global_batch_size=BATCH, steps=STEPS, seed=SEED, progress=False)
            got = trainer.full_state_dict()
    # The owners (2) and Ray Data's own actors are all fit may start; the old scan's task per
    # block started 84 at this block count.
    assert 2 <= len(new) <= cpus, (len(new), cpus)
    layout = RayDataset(ds).scan()  # the blocks fit executed (once per Dataset object)
    assert layout.block_sizes == (1,) * BLOCKS and layout.offsets == (0,) * BLOCKS
    assert result["step"] == STEPS
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-6


def test_pandas_blocks_and_sliced_blocks_read_as_the_datasets_rows() -> None:
    frames = [pd.DataFrame({"n": np.arange(10 * i, 10 * i + 10), "tokens": [[i, j] for j in range(10)]})
              for i in range(3)]
    layout = RayDataset(ray.data.from_pandas(frames), columns=("n",)).scan()
    assert layout.block_sizes == (10, 10, 10) and layout.columns == ("n",)
    assert [ray.get(r).__class__ for r in layout.refs] == [pd.DataFrame] * 3  # converted by the reader, not a task
    got = np.concatenate([layout.read_block(b, None).columns["n"] for b in range(3)])
    assert got.tolist() == list(range(30))

    # Ray Data may hand out part of a block (RefBundle.slices): rows 3..7 of a 10-row block.
    table = pa.table({"n": np.arange(10), "tokens": [[k] * (k + 1) for k in range(10)]})
    source = RayDataset(None, columns=("n", "tokens"))
    sliced = RayDatasetLayout(source=source, refs=(ray.put(table),), block_sizes=(4,), group_bytes=(table.nbytes,),
                              offsets=(3,), columns=("n", "tokens"), cache_bytes=1 << 20)
    block = sliced.read_block(0, None)
    assert [block.sample(i)["n"].item() for i in range(4)] == [3, 4, 5, 6]
    assert [block.sample(i)["tokens"].tolist() for i in range(4)] == [[k] * (k + 1) for k in range(3, 7)]
    beyond = RayDatasetLayout(source=source, refs=(ray.put(table),), block_sizes=(4,), group_bytes=(table.nbytes,),
                              offsets=(8,), columns=("n",), cache_bytes=1 << 20)
    with pytest.raises(zr.DataError, match=r"holds 10 rows; Ray Data reported rows 8\.\.12"):
        beyond.read_block(0, None)
