"""Measured model-state bytes and bytes sent equal the paper's formulas, to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_ray as zr
from zero_ray.core.memory_formulas import model_state_bytes, optimizer_bytes_per_param, tier_bytes

pytestmark = pytest.mark.usefixtures("ray_session")



def _model() -> torch.nn.Module:
    from zero_ray.models import mlp

    return mlp(23, 3)  # 3 * (23*23 + 23) = 1656 parameters: padding at world size 5 is not zero


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).pow(2).mean()


# Every stage with both dtypes; the formulas themselves are checked for every N in tests/unit/test_memory.py.
CASES = [(0, 2, "float32"), (0, 3, "bfloat16"), (1, 3, "float32"), (1, 2, "bfloat16"), (2, 2, "float32"),
         (2, 3, "bfloat16")]


@pytest.mark.parametrize(("stage", "world_size", "dtype"), CASES)
def test_model_state_bytes_and_communication_match_the_paper(stage: int, world_size: int, dtype: str) -> None:
    trainer = zr.ZeroTrainer(_model, _loss, optimizer=zr.AdamW(lr=1e-3),
                             config=zr.ZeroConfig(stage=stage, world_size=world_size, dtype=dtype, bucket_bytes=2048))
    try:
        trainer.step(torch.randn(world_size * 3, 23))
        memory, comm = trainer.memory_report(), trainer.comm_report()
    finally:
        trainer.shutdown()
    mixed = dtype != "float32"
    element = 2 if mixed else 4
    k = optimizer_bytes_per_param("adamw", mixed_precision=mixed)
    padded = memory[0]["padded_numel"]
    assert memory[0]["numel"] == 1656
    expected = model_state_bytes(stage=stage, num_params=padded, world_size=world_size, param_bytes=element,
                                 grad_bytes=element, optimizer_bytes=k)
    for rank in memory:
        # everything held, padding included, is the formula over the padded buffers
        assert rank["params"] + rank["padding_params"] == expected.params
        assert rank["grads"] + rank["padding_grads"] == expected.grads
        assert rank["optimizer"] + rank["padding_optimizer"] == expected.optimizer
        # beside the paper's K per element, torch keeps AdamW's step as one fp32 per parameter fragment
        assert rank["total"] - rank["optimizer_scalars"] == expected.total
        assert rank["total"] == rank["held_storage_bytes"]
        assert rank["optimizer_scalars"] % 4 == 0 and 0 < rank["optimizer_scalars"] <= 4 * 6
    if stage == 0:  # replicated: every rank steps the six parameters whole
        assert all(r["optimizer_scalars"] == 4 * 6 for r in memory)
    else:  # each parameter is stepped in one fragment per rank whose shard holds part of it
        assert 4 * 6 <= sum(r["optimizer_scalars"] for r in memory) <= 4 * 6 * world_size
    # without padding, the sharded categories add up to exactly Psi across ranks
    real = model_state_bytes(stage=stage, num_params=1656, world_size=1, param_bytes=element, grad_bytes=element,
                             optimizer_bytes=k)
    if stage >= 1:
        assert sum(r["optimizer"] for r in memory) == real.optimizer
    if stage >= 2:
        assert sum(r["grads"] for r in memory) == real.grads
    for rank in comm:
        model_state = rank["total"] - rank.get("scalars", 0)
        assert model_state == 2 * (world_size - 1) * padded // world_size * element
        assert rank.get("scalars", 0) <= 64  # the global gradient norm, a few bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_offloaded_bytes_and_what_stays_resident_match_the_formulas(world_size: int, tmp_path: Path) -> None:
    # Stage 3, the optimizer state and the parameter and gradient shards on disk (ZeRO-Infinity's NVMe tier).
    offload = zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path))
    trainer = zr.ZeroTrainer(_model, _loss, optimizer=zr.AdamW(lr=1e-3),
                             config=zr.ZeroConfig(stage=3, world_size=world_size, bucket_bytes=2048,
                                                  offload=offload))
    try:
        trainer.step(torch.randn(world_size * 3, 23))
        memory = trainer.memory_report()
    finally:
        trainer.shutdown()
    padded = memory[0]["padded_numel"]
    state = model_state_bytes(stage=3, num_params=padded, world_size=world_size, param_bytes=4, grad_bytes=4,
                              optimizer_bytes=optimizer_bytes_per_param("adamw", mixed_precision=False))
    tiers = tier_bytes(state, stage=3, optimizer="nvme", params="nvme")
    for rank in memory:
        assert rank["total"] == rank["held_storage_bytes"]
        assert rank["nvme"] == tiers.nvme == state.total  # the step's whole model state, padding included
        # what stays in memory: the formula's device share (none), torch's per-fragment step counts and
        # the working set, a unit's gather buffer and its gradients' staging buffer
        working = rank["gather_buffers"] + rank["reduce_buffers"]
        assert working == 2 * 4 * padded
        assert rank["resident"] - rank["optimizer_scalars"] - working == tiers.device == 0
