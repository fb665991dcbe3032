"""ZeRO across tensor-parallel groups for the issue's other two models (issue 45: "a second
Hugging Face architecture with a plan; a user plan on a plain module"), at every stage with SGD
and AdamW, on thread ranks at (T, D) = (2, 2): a Qwen2 (biased q/k/v projections) sharded by its
own ``base_model_tp_plan``, and a plain module sharded by a user's plan. Each ends within 1e-5 of
single-process torch (each batch split as the D ranks split it), losses too, with global
clipping. The Llama's full matrix of layouts is test_tensor_parallel_engine_threads.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from test_tensor_parallel_plan import PLAIN_PLAN, PlainNet
from thread_ranks import run_tp_ranks
from tp_llama import BATCH, CLIP, OPTIMIZERS, VOCAB, batches, lm_loss
from zero_ray.testing import single_process

TOLERANCE = 1e-5
STEPS = 4


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # 8 query heads over 4 key/value heads, as the Llama's: at T = 2 each rank holds 4 and 2
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return Qwen2ForCausalLM(config)


def plain_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def plain_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(BATCH, 5, 8, generator=g) for _ in range(steps)]


Model = tuple[Callable[[], nn.Module], Any, Callable[[int], list[Any]], Any]
MODELS: dict[str, Model] = {
    "qwen2-own-plan": (qwen2, lm_loss, batches, None),
    "plain-user-plan": (PlainNet, plain_loss, plain_batches, PLAIN_PLAN),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_other_models_match_single_process_at_every_stage(name: str, stage: int, optimizer: str) -> None:
    build, loss, batches_of, plan = MODELS[name]
    size, data_parallel = 2, 2
    ref, ref_losses = single_process(build, loss, OPTIMIZERS[optimizer], batches_of(STEPS), max_grad_norm=CLIP,
                                     pieces=(data_parallel, 1))
    got, losses, engines, _ = run_tp_ranks(size, data_parallel, build, loss, OPTIMIZERS[optimizer], batches_of(STEPS),
                                           plan=plan, stage=stage, clip=CLIP)
    assert got.keys() == ref.keys()
    for key, value in got.items():
        assert value.shape == ref[key].shape, key
        assert float((value - ref[key]).abs().max()) <= TOLERANCE, key
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE
    # the plan split the layers: their partial outputs were summed over each TP group
    assert all(e.last_bytes["tp_all_reduce"] > 0 for e in engines)
