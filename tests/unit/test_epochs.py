"""fit()'s sample order (core/data_order.py): pure, no Ray."""

from __future__ import annotations

import pytest
import torch

from zero_ray.core.data_order import EpochOrder, evaluation_chunks
from zero_ray.errors import ConfigError


def test_global_batches_are_consecutive_slices_of_each_epochs_permutation() -> None:
    order = EpochOrder(length=10, global_batch_size=3, seed=5)  # 3 batches an epoch, one sample dropped
    assert order.batches_per_epoch == 3
    for step in range(7):
        epoch, k = divmod(step, 3)
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch))  # the documented order
        assert order.indices(step) == tuple(perm[3 * k:3 * k + 3].tolist())
        assert order.position(step) == (epoch, k)


@pytest.mark.parametrize("length", [7, 1000, 3_000_000])
def test_the_stored_order_is_torchs_default_permutation(length: int) -> None:
    order = EpochOrder(length=length, global_batch_size=length // 2 or 1, seed=1)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(1))  # int64, the documented call
    assert order.indices(1) == tuple(perm[order.global_batch_size:2 * order.global_batch_size].tolist())


def test_a_batch_larger_than_the_dataset_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="global_batch_size=11 is larger than the dataset \\(10 samples\\)"):
        EpochOrder(length=10, global_batch_size=11)
    with pytest.raises(ConfigError, match="length=0"):
        EpochOrder(length=0, global_batch_size=1)


def test_evaluation_reads_every_sample_once_and_gives_every_rank_one() -> None:
    assert list(evaluation_chunks(10, 4, 2)) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert list(evaluation_chunks(9, 4, 2)) == [(0, 1, 2, 3), (4, 5, 6, 7, 8)]  # a lone sample joins the last chunk
    assert list(evaluation_chunks(3, 8, 3)) == [(0, 1, 2)]
    with pytest.raises(ConfigError, match="2 samples, fewer than the 3 owners"):
        list(evaluation_chunks(2, 8, 3))
