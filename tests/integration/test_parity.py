"""Stages 0-2 against single-process PyTorch (and DDP), on real Ray actors over gloo.

SGD must match the single process to 1e-6. With AdamW, splitting a batch changes float
summation and Adam's normalisation magnifies that where gradients are near zero, so zero_ray
must be as close to the single process as PyTorch DDP is at the same world size on the same
data; both deviations are printed.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zero_ray as zr
from zero_ray.models import GPT, GPTConfig, lm_loss, mlp, mse_loss
from zero_ray.testing import ddp_params, single_process

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS = 5
GLOBAL_BATCH = 13  # uneven across 2, 3 and 4 ranks


def mlp_batches(steps: int = STEPS, n: int = GLOBAL_BATCH, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)) for _ in range(steps)]


def gpt_batches(cfg: GPTConfig, steps: int = STEPS, n: int = GLOBAL_BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, cfg.vocab_size, (n, 17), generator=g) for _ in range(steps)]


MLP_FN = functools.partial(mlp, 16, 3)
GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
GPT_FN = functools.partial(GPT, GPT_CFG)


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def train_zero(model_fn, loss_fn, optimizer, batches, **config):  # type: ignore[no-untyped-def]
    trainer = zr.ZeroTrainer(model_fn, loss_fn, optimizer=optimizer, config=zr.ZeroConfig(**config))
    try:
        metrics = [trainer.step(b) for b in batches]
        return trainer.full_state_dict(), metrics
    finally:
        trainer.shutdown()


# Every stage x world size runs in the thread tier (tests/unit/*_threads.py); here real actors over
# gloo on a subset that still has every stage and world size in it.
SGD_CASES = [(0, 1), (0, 4), (1, 3), (2, 2), (2, 4)]


@pytest.mark.parametrize(("stage", "world_size"), SGD_CASES)
def test_sgd_matches_single_process(stage: int, world_size: int) -> None:
    opt = zr.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)
    batches = mlp_batches()
    ref, ref_losses = single_process(MLP_FN, mse_loss, opt, batches, max_grad_norm=0.15)
    params, metrics = train_zero(MLP_FN, mse_loss, opt, batches, stage=stage, world_size=world_size,
                                 grad_accum_steps=2, max_grad_norm=0.15, bucket_bytes=2048)
    assert any(m["grad_norm"] > 0.15 for m in metrics), "clipping never engaged; the test would not cover it"
    dev = max_dev(params, ref)
    print(f"stage {stage} world {world_size} SGD max |zero - single| = {dev:.3g}")
    assert dev <= 1e-6
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-6)


ADAM_CASES = [(0, 3), (1, 4), (2, 2)]


@pytest.mark.parametrize(("stage", "world_size"), ADAM_CASES)
def test_adamw_is_as_close_to_single_process_as_ddp(stage: int, world_size: int) -> None:
    opt = zr.AdamW(lr=1e-3, weight_decay=0.1)
    batches = mlp_batches()
    ref, _ = single_process(MLP_FN, mse_loss, opt, batches, max_grad_norm=1.0)
    params, _ = train_zero(MLP_FN, mse_loss, opt, batches, stage=stage, world_size=world_size, max_grad_norm=1.0,
                           bucket_bytes=2048)
    # DDP as its ranks' splits of every batch in one process: on this MLP it and DDP on actors
    # both measured 1.49e-08 / 2.98e-08 / 1.49e-08 (3, 4, 2 ranks), far under 1e-6 / 2, so the
    # bound is 1e-6 either way and world_size actors' starts are saved; DDP on actors is the GPT
    # case's below.
    ddp, _ = single_process(MLP_FN, mse_loss, opt, batches, max_grad_norm=1.0, pieces=(world_size, 1))
    zero_dev, ddp_dev = max_dev(params, ref), max_dev(ddp, ref)
    print(f"stage {stage} world {world_size} AdamW: zero_ray {zero_dev:.3g}, DDP {ddp_dev:.3g}")
    assert zero_dev <= max(2 * ddp_dev, 1e-6)


@functools.cache
def _gpt_ddp() -> dict[str, torch.Tensor]:
    """DDP's parameters on the tied GPT's batches at 2 ranks: they do not depend on the stage, so
    both stages' cases compare with one DDP run (its actors' start is most of its cost)."""
    return ddp_params(GPT_FN, lm_loss, zr.AdamW(lr=1e-3), gpt_batches(GPT_CFG), world_size=2, max_grad_norm=1.0)


@pytest.mark.parametrize("stage", [0, 2])
def test_gpt_with_tied_embeddings_and_accumulation(stage: int) -> None:
    opt = zr.AdamW(lr=1e-3)
    batches = gpt_batches(GPT_CFG)
    ref, ref_losses = single_process(GPT_FN, lm_loss, opt, batches, max_grad_norm=1.0)
    params, metrics = train_zero(GPT_FN, lm_loss, opt, batches, stage=stage, world_size=2, grad_accum_steps=2,
                                 max_grad_norm=1.0, bucket_bytes=16 * 1024)
    assert "head.weight" not in params  # tied to wte.weight: one parameter, as named_parameters() says
    ddp_dev = max_dev(_gpt_ddp(), ref)
    zero_dev = max_dev(params, ref)
    print(f"GPT stage {stage} world 2 AdamW: zero_ray {zero_dev:.3g}, DDP {ddp_dev:.3g}")
    assert zero_dev <= max(2 * ddp_dev, 1e-6)
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
