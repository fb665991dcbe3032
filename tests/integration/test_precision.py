"""Mixed precision: bf16 within a documented tolerance of fp32; fp16 loss scaling skips
overflowing steps without touching the weights."""

from __future__ import annotations

import functools

import pytest
import torch

import zero_ray as zr
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = functools.partial(mlp, 16, 3)
# bf16 keeps 8 mantissa bits: after 5 AdamW steps at lr 1e-3 the fp32 master weights differ from
# an fp32 run by at most a few lr-sized steps (docs/numerics.md states this tolerance).
BF16_PARAM_TOLERANCE = 5e-3
BF16_LOSS_RTOL = 2e-2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)) for _ in range(5)]


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_compute_with_fp32_master_weights_tracks_fp32(stage: int) -> None:
    opt = zr.AdamW(lr=1e-3)
    ref, ref_losses = single_process(MODEL, mse_loss, opt, _batches())
    with zr.ZeroTrainer(MODEL, mse_loss, optimizer=opt,
                        config=zr.ZeroConfig(stage=stage, world_size=2, dtype="bfloat16")) as trainer:
        losses = [trainer.step(b)["loss"] for b in _batches()]
        params = trainer.full_state_dict()
        memory = trainer.memory_report()[0]
    dev = max(float((params[n] - ref[n]).abs().max()) for n in ref)
    print(f"bf16 stage {stage}: max |bf16 - fp32| = {dev:.3g}")
    assert params["0.weight"].dtype == torch.float32
    assert dev <= BF16_PARAM_TOLERANCE
    assert losses == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL)
    assert memory["optimizer_master"] > 0  # fp32 master copy of the owned slice exists


def test_fp16_dynamic_loss_scaling_skips_overflowing_steps() -> None:
    cfg = zr.ZeroConfig(stage=2, world_size=2, dtype="float16",
                        loss_scale=zr.LossScaleConfig(init_scale=2.0**24, growth_interval=1000))
    with zr.ZeroTrainer(MODEL, mse_loss, optimizer=zr.AdamW(lr=1e-3), config=cfg) as trainer:
        before = trainer.full_state_dict()
        first = trainer.step(_batches()[0])
        after_skip = trainer.full_state_dict()
        metrics = []
        for _ in range(20):  # the scale halves on every overflow until gradients fit in fp16
            metrics.append(trainer.step(_batches()[1]))
            if not metrics[-1]["skipped"]:
                break
        final = trainer.full_state_dict()
    assert first["skipped"] and first["loss_scale"] == 2.0**24
    assert all(torch.equal(before[n], after_skip[n]) for n in before)  # a skipped step changes nothing
    scales = [m["loss_scale"] for m in metrics]
    assert scales == [2.0**(23 - i) for i in range(len(scales))]
    assert not metrics[-1]["skipped"] and all(m["skipped"] for m in metrics[:-1])
    assert any(not torch.equal(before[n], final[n]) for n in before)
