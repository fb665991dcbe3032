"""The tensor-parallel tests' shared model and reference (thread ranks and Ray alike): a small
Hugging Face Llama with grouped-query attention (8 query heads over 4 key/value heads, its own
``base_model_tp_plan``), its loss, seeded token batches and single-process torch trained on them
as D data-parallel ranks would split them."""

from __future__ import annotations

import functools

import torch
from torch import nn

import zero_ray as zr
from zero_ray.testing import single_process

VOCAB, BATCH, SEQ = 64, 4, 10
CLIP = 0.5  # below the first steps' global norms (asserted), so clipping changes every update
OPTIMIZERS = {"sgd": zr.SGD(lr=0.1, momentum=0.9), "adamw": zr.AdamW(lr=1e-3, weight_decay=0.01)}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # 8 query heads over 4 key/value heads: at T = 4 each rank holds 2 query heads and 1 kv head
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


@functools.cache
def reference(optimizer: str, data_parallel: int, steps: int,
              clip: float | None = CLIP) -> tuple[dict[str, torch.Tensor], tuple[float, ...]]:
    """Parameters and per-step losses of single-process torch, each batch split as D ranks split
    it (the loss weighted per piece): the same sums, in the same order."""
    params, losses = single_process(llama, lm_loss, OPTIMIZERS[optimizer], batches(steps), max_grad_norm=clip,
                                    pieces=(data_parallel, 1))
    return params, tuple(losses)


@functools.cache
def first_norm() -> float:
    """The unclipped global gradient norm of the first step, in one process."""
    torch.manual_seed(0)
    model = llama()
    lm_loss(model, batches(1)[0]).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
