"""The pair-form loss (loss_sum, count) on thread ranks: padded batches at every stage, world
sizes 1-3 and two micro-batches give the single-process token mean (the same runs on Ray actors
with a Hugging Face Llama are in tests/integration/test_training_loop.py)."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from finetune_models import llama, padded_token_batches, token_mean_loss, token_sum_loss
from test_units_threads import _max_dev, run_ranks
from zero_ray.owner.step.engine import loss_terms
from zero_ray.testing import single_process


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_padded_batches_train_to_the_global_token_mean(stage: int, world_size: int) -> None:
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = padded_token_batches()
    ref, _ = single_process(llama, token_mean_loss, opt, batches)
    got, _, _ = run_ranks(world_size, llama, token_sum_loss, opt, batches, accum=2, stage=stage)
    assert _max_dev(got, ref) <= 1e-6


def test_the_per_rank_mean_is_not_the_global_token_mean() -> None:
    # What the pair form fixes: each rank averaging its own tokens weights tokens unevenly.
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = padded_token_batches()
    ref, _ = single_process(llama, token_mean_loss, opt, batches)
    got, _, _ = run_ranks(2, llama, token_mean_loss, opt, batches, stage=1)
    assert _max_dev(got, ref) > 1e-4


@pytest.mark.parametrize(("out", "message"), [
    ((torch.tensor(1.0), torch.tensor([1, 2])), "count must be an int or a 0-d tensor"),
    ((torch.tensor(1.0), -3), "count=-3 must be a finite number"),
    ((torch.tensor(1.0), True), "count=True"),
    ((torch.ones(2), 4), "loss_sum must be a scalar tensor"),
    ((torch.tensor(1.0), 2, 3), "tuple of 3 items"),
    (torch.ones(3), r"must return a scalar tensor \(the mean loss over the batch\) or the pair"),
])
def test_bad_loss_returns_name_the_value(out: object, message: str) -> None:
    with pytest.raises(zr.ModelError, match=message):
        loss_terms(out)
