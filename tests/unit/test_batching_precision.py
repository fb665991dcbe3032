"""Batch splitting, config validation and the loss scaler (pure)."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from zero_ray.core.batching import batch_size, split_batch, split_sizes
from zero_ray.core.precision import LossScaleConfig, LossScaler, parse_dtype
from zero_ray.core.lr_schedule import WarmupCosine
from zero_ray.errors import ConfigError


def test_split_sizes_are_as_even_as_possible() -> None:
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(4, 4) == [1, 1, 1, 1]
    assert sum(split_sizes(1001, 7)) == 1001


@pytest.mark.parametrize("batch", [
    torch.arange(10.0).reshape(5, 2),
    (torch.zeros(5, 2), torch.ones(5)),
    {"x": torch.zeros(5, 3), "y": torch.arange(5)},
])
def test_split_batch_keeps_structure_and_order(batch) -> None:  # type: ignore[no-untyped-def]
    pieces = split_batch(batch, [3, 2])
    assert [batch_size(p) for p in pieces] == [3, 2]
    assert type(pieces[0]) is type(batch)


def test_batches_with_disagreeing_sizes_or_no_tensors_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"sizes \[4, 5\]"):
        batch_size((torch.zeros(4), torch.zeros(5)))
    with pytest.raises(ConfigError, match="not str"):
        batch_size("tokens")  # type: ignore[arg-type]


def test_loss_scaler_backs_off_on_overflow_and_grows_after_an_interval() -> None:
    scaler = LossScaler(config=LossScaleConfig(init_scale=8.0, growth_interval=2), enabled=True)
    assert scaler.update(found_inf=True) and scaler.scale == 4.0
    assert not scaler.update(found_inf=False) and scaler.scale == 4.0
    assert not scaler.update(found_inf=False) and scaler.scale == 8.0
    assert LossScaler(config=LossScaleConfig(), enabled=False).scale == 1.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"stage": 5}, "stage=5"),
    ({"world_size": 0}, "world_size=0"),
    ({"dtype": "int8"}, "int8"),
    ({"grad_accum_steps": 0}, "grad_accum_steps=0"),
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0"),
    ({"device": "tpu"}, "tpu"),
    ({"device": "cpu", "backend": "nccl"}, "nccl"),
    ({"collective_timeout_s": 0}, "collective_timeout_s=0"),
])
def test_zero_config_rejects_bad_values_by_name(kwargs, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        zr.ZeroConfig(**kwargs)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = zr.ZeroConfig()
    with pytest.raises(AttributeError):
        cfg.stage = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        zr.ZeroConfig(2)  # type: ignore[misc]


def test_dtype_names_and_schedule() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    sched = WarmupCosine(warmup_steps=2, total_steps=10, min_ratio=0.1)
    assert sched.multiplier(0) == pytest.approx(1 / 3) and sched.multiplier(2) == pytest.approx(1.0)
    assert sched.multiplier(10) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="total_steps=2"):
        WarmupCosine(warmup_steps=2, total_steps=2)
