"""Fine-tuning on thread ranks (no Ray): frozen parameters, a never-used parameter and a branch
only some ranks take, at every stage and world sizes 1-3, against single-process PyTorch that
computes the same pieces; a stage-3 unit whose own forward is bypassed (as PEFT bypasses
``LoraModel.forward``) and PEFT LoRA over tied-embedding Hugging Face models. The same runs on
Ray actors are in tests/integration/test_finetune.py."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from finetune_models import (
    FineTune,
    causal_lm_loss,
    finetune_batches,
    finetune_loss,
    lora_gpt2,
    lora_tied_llama,
    token_batches,
)
from test_units_threads import _max_dev
from thread_ranks import run_ranks
from torch import nn
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.owner.construction.sources import check_module
from zero_ray.testing import single_process

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


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.norm = nn.LayerNorm(16)  # with Linear units nested, what the wrapper's unit holds
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(torch.tanh(self.embed(x)))))


class Wrapper(nn.Module):
    """Holds the model, like PEFT's ``LoraModel``; its own forward is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("never called: Bypassing calls the wrapped model directly")


class Bypassing(nn.Module):
    """Calls its child's child, as ``PeftModel.forward`` calls ``base_model.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = Wrapper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.model(x)


class CallsTheLeaves(Bypassing):
    """Calls the wrapped model's modules one by one: its unit is entered four times per forward,
    the first time from the data (no input needs a gradient, so nothing signals when backward is
    past that call), the others from activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.base.model
        return m.head(m.norm(m.body(torch.tanh(m.embed(x)))))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(("model_fn", "policy"), [
    (Bypassing, WrapPolicy(min_numel=0)), (Bypassing, WrapPolicy(classes=("Wrapper", "Linear"))),
    (CallsTheLeaves, WrapPolicy(min_numel=0))], ids=["wrapper", "wrapper-and-nested", "entered-four-times"])
def test_a_unit_whose_forward_is_bypassed_is_gathered_by_the_module_under_it_that_runs(
        model_fn, policy: WrapPolicy, world_size: int) -> None:  # type: ignore[no-untyped-def]
    # The wrapper is a unit (the default policy's choice for a root's only child); before
    # entry modules its parameters stayed empty placeholders and the first Linear failed. Entered
    # four times, it ended when backward passed the first tracked entry, before the embedding's
    # gradient arrived ("arrived after its bucket was reduced").
    opt = zr.SGD(lr=0.1, momentum=0.9)
    batches = [(x[:, :8], y[:, :4]) for x, y in finetune_batches()]
    ref, _ = single_process(model_fn, finetune_loss, opt, batches)
    got, engines, _ = run_ranks(world_size, model_fn, finetune_loss, opt, batches, accum=2, wrap_policy=policy)
    assert _max_dev(got, ref) <= 1e-6
    torch.manual_seed(0)
    start = dict(model_fn().named_parameters())
    assert all(not torch.equal(got[n], p.detach()) for n, p in start.items())  # every parameter trained
    assert "base" in [u.spec.path for u in engines[0].state.units]


TIED_CASES = [(stage, n) for stage in (0, 1, 2, 3) for n in (1, 2, 3)]
BLOCKS = {lora_gpt2: "GPT2Block", lora_tied_llama: "LlamaDecoderLayer"}


@pytest.mark.parametrize(("stage", "world_size"), TIED_CASES)
@pytest.mark.parametrize("model_fn", [lora_gpt2, lora_tied_llama], ids=["gpt2", "tied-llama"])
def test_peft_lora_over_tied_embeddings_follows_torch(model_fn, stage: int,  # type: ignore[no-untyped-def]
                                                      world_size: int) -> None:
    # At stage 3 every module is a candidate unit (WrapPolicy(min_numel=0)): PEFT's base_model,
    # whose forward PEFT bypasses, is the unit holding the tied embedding.
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches()
    ref, _ = single_process(model_fn, causal_lm_loss, opt, batches)
    got, _, _ = run_ranks(world_size, model_fn, causal_lm_loss, opt, batches, stage=stage)
    assert _max_dev(got, ref) <= 1e-6
    torch.manual_seed(0)
    start = dict(model_fn().named_parameters())
    assert all(torch.equal(got[n], p.detach()) == (not p.requires_grad) for n, p in start.items())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_fn", [lora_gpt2, lora_tied_llama], ids=["gpt2", "tied-llama"])
def test_peft_lora_over_tied_embeddings_with_block_units_follows_torch(model_fn,  # type: ignore[no-untyped-def]
                                                                       world_size: int) -> None:
    # Each decoder block a unit: the tied embedding is the root's, used at both ends of forward.
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches()
    ref, _ = single_process(model_fn, causal_lm_loss, opt, batches)
    got, engines, _ = run_ranks(world_size, model_fn, causal_lm_loss, opt, batches, accum=2,
                                wrap_policy=WrapPolicy(classes=(BLOCKS[model_fn],)))
    assert _max_dev(got, ref) <= 1e-6
    assert [u.spec.path.rsplit(".", 1)[-1] for u in engines[0].state.units] == ["", "0", "1"]
