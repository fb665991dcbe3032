"""A run's position and training configuration on real owners: a run with clipping,
accumulation and a scheduler, saved and resumed without a config, equals the uninterrupted run
bit for bit, and a conflicting config is refused before any owner starts. A NaN batch under
on_nonfinite="raise" (the error names the step and rank; the trainer goes on) and under "skip"
leaves the model as the run that never saw it. Three trainer starts in all."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import zero_ray as zr
from zero_ray.config import training_record
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = functools.partial(mlp, 16, 3)
OPT = zr.AdamW(lr=5e-2)
SCHED = zr.WarmupCosine(warmup_steps=2, total_steps=10)
# Clipping that bites (the global norm is far above 0.05 every step) and two micro-batches.
CONFIG = zr.ZeroConfig(stage=2, world_size=2, grad_accum_steps=2, max_grad_norm=0.05, bucket_bytes=4096)
BATCH = 12


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 16, generator=g) * 3, torch.randn(BATCH, 16, generator=g)) for _ in range(5)]


def with_nan(batch: tuple[torch.Tensor, torch.Tensor], row: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = batch[0].clone()
    x[row, 3] = float("nan")
    return x, batch[1]


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_resume_without_config_and_a_nan_batch_under_raise_and_skip(tmp_path: Path) -> None:
    data = batches()
    reference, _ = single_process(MODEL, mse_loss, OPT, data, max_grad_norm=0.05, lr_scheduler=SCHED, pieces=(2, 2))

    trainer = zr.ZeroTrainer(MODEL, mse_loss, optimizer=OPT, lr_scheduler=SCHED, config=CONFIG)  # "raise": the default
    try:
        trainer.step(data[0])
        trainer.step(data[1])
        with pytest.raises(zr.NonFiniteError) as err:
            trainer.step(with_nan(data[2], 9))  # rows 6..11 are rank 1's
        assert (err.value.step, err.value.loss_ranks) == (3, (1,))
        assert str(err.value).startswith("step 3: non-finite values in the loss on rank 1")
        assert (trainer.step_count, trainer.samples_seen, trainer.state.value) == (2, 24, "ready")
        assert trainer.recoveries == []  # a refused step is not a failure
        trainer.step(data[2])  # the trainer goes on
        path = trainer.save_checkpoint(tmp_path, wait=True)  # step 3
        for b in data[3:]:
            trainer.step(b)
        uninterrupted = trainer.full_state_dict()
        # fit() stops with the error too: the user decides.
        poisoned = TensorDataset(torch.full((BATCH, 16), float("nan")), torch.zeros(BATCH, 16))
        with pytest.raises(zr.NonFiniteError, match=f"step {trainer.step_count + 1}: "):
            trainer.fit(poisoned, global_batch_size=BATCH, steps=trainer.step_count + 1, progress=False)
    finally:
        trainer.shutdown()
    dev = max_dev(uninterrupted, reference)
    print(f"ZeRO-2 x 2 with a refused NaN batch vs one process that never saw it: {dev:.2e}")
    assert dev <= 1e-6

    # A config that would change the math is refused, naming the field, before any owner starts.
    with pytest.raises(zr.ConfigError, match=r"max_grad_norm=0\.05 in the checkpoint but 1\.0 in config.*"
                                             r"override=\('max_grad_norm',\)"):
        zr.ZeroTrainer.from_checkpoint(path, MODEL, mse_loss, lr_scheduler=SCHED,
                                       config=dataclasses.replace(CONFIG, max_grad_norm=1.0))
    resumed = zr.ZeroTrainer.from_checkpoint(path, MODEL, mse_loss, lr_scheduler=SCHED)  # no config
    try:
        assert training_record(resumed.config) == training_record(CONFIG)
        assert (resumed.config.stage, resumed.world_size) == (2, 2)
        assert (resumed.step_count, resumed.samples_seen) == (3, 36)
        for b in data[resumed.step_count:]:
            resumed.step(b)
        assert max_dev(resumed.full_state_dict(), uninterrupted) == 0.0
    finally:
        resumed.shutdown()

    skipping = zr.ZeroTrainer(MODEL, mse_loss, optimizer=OPT, lr_scheduler=SCHED,
                              config=dataclasses.replace(CONFIG, on_nonfinite="skip"))
    try:
        skipping.step(data[0])
        skipping.step(data[1])
        metrics = skipping.step(with_nan(data[2], 9))
        assert metrics["skipped"] and metrics["nonfinite_loss_ranks"] == [1] and metrics["step"] == 3
        assert "step 3: non-finite values in the loss on rank 1" in skipping.events[-1]
        for b in data[2:]:
            skipping.step(b)
        assert (skipping.step_count, skipping.samples_seen) == (6, 72)  # the skipped step counts
        assert max_dev(skipping.full_state_dict(), uninterrupted) == 0.0  # neither applied it
        # fit() goes on past a non-finite batch: of the 24 samples one is NaN, so one of the two steps skips.
        x = torch.randn(2 * BATCH, 16)
        x[5, 0] = float("nan")
        out = skipping.fit(TensorDataset(x, torch.zeros(2 * BATCH, 16)), global_batch_size=BATCH,
                           steps=skipping.step_count + 2, progress=False)
        assert out["steps_run"] == 2 and skipping.events[-1].endswith("skipped")
    finally:
        skipping.shutdown()
