"""Fine-tuning on thread ranks (no Ray): frozen parameters, a never-used parameter and a branch
only some ranks take, at every stage and world sizes 1-3, against single-process PyTorch that
computes the same pieces. The same runs on Ray actors are in tests/integration/test_finetune.py."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from finetune_models import FineTune, finetune_batches, finetune_loss
from test_units_threads import _max_dev
from thread_ranks import run_ranks
from zero_ray.bench.baselines import single_process
from zero_ray.owner.sources import check_module

CASES = [(stage, n) for stage in (0, 1, 2, 3) for n in (1, 2, 3)]


@pytest.mark.parametrize(("stage", "world_size"), CASES)
def test_frozen_unused_and_branching_parameters_follow_torch(stage: int, world_size: int) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9, weight_decay=0.1)
    batches = finetune_batches()
    ref, _ = single_process(FineTune, finetune_loss, opt, batches, pieces=(world_size, 2))
    got, engines, _ = run_ranks(world_size, FineTune, finetune_loss, opt, batches, accum=2, stage=stage)
    torch.manual_seed(0)
    start = dict(FineTune().named_parameters())
    assert _max_dev(got, ref) <= 1e-6
    for name in ("unused", "base.0.weight", "base.2.bias"):  # never updated: no decay, no momentum
        assert torch.equal(got[name], start[name].detach()), name
    assert not torch.equal(got["block.branch.weight"], start["block.branch.weight"])
    report = engines[0].memory_report()
    trainable = sum(p.numel() for p in FineTune().parameters() if p.requires_grad)
    assert report["trainable_numel"] == trainable


def test_a_branch_taken_in_some_steps_keeps_its_own_step_count() -> None:
    opt = zr.AdamW(lr=1e-2, weight_decay=0.1)
    batches = finetune_batches(steps=4)
    ref, _ = single_process(FineTune, finetune_loss, opt, batches, pieces=(1, 1))
    got, engines, _ = run_ranks(1, FineTune, finetune_loss, opt, batches, stage=1)
    assert _max_dev(got, ref) <= 1e-6  # Adam's bias correction uses the branch's own count
    state = engines[0].state
    # torch's own per-parameter state: a parameter without a gradient in a step is not stepped
    table = state.optimizer.table()
    steps = {p.name: table[p.index]["scalars"]["step"][2] if p.index in table else 0 for p in state.layout.params}
    assert steps["block.adapter.weight"] == 4 and steps["unused"] == 0 and steps["base.0.weight"] == 0
    assert steps["block.branch.weight"] == 2  # the whole batch took the branch in steps 0 and 2


def test_a_module_with_nothing_to_train_is_refused_by_name() -> None:
    module = FineTune().requires_grad_(False)
    with pytest.raises(zr.ModelError, match="every one of the module's 11 parameters has requires_grad=False"):
        check_module(module)
