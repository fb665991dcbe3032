"""Bad input gives a clear error that names the value, and never a hang."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from zero_ray.models import mlp

pytestmark = pytest.mark.usefixtures("ray_session")


def _model() -> torch.nn.Module:
    return mlp(8, 2)


def _loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).pow(2).mean()


def test_world_size_larger_than_the_cluster_names_the_resources() -> None:
    # capacity_timeout_s=0: fail at once instead of waiting for nodes to join (test_capacity_wait.py)
    with pytest.raises(zr.ResourceError, match=r"64 owners need \{'CPU': 1\} each; the cluster's live nodes hold 8"):
        zr.ZeroTrainer(_model, _loss, config=zr.ZeroConfig(world_size=64, capacity_timeout_s=0))


def test_stage_outside_range_is_refused_before_anything_starts() -> None:
    with pytest.raises(zr.ConfigError, match="stage=4 is outside 0..3"):
        zr.ZeroConfig(stage=4)


def test_global_batch_smaller_than_world_size() -> None:
    with zr.ZeroTrainer(_model, _loss, config=zr.ZeroConfig(world_size=2)) as trainer:
        with pytest.raises(zr.ConfigError, match="global batch of 1 samples is smaller than world_size"):
            trainer.step(torch.randn(1, 8))
        assert trainer.step(torch.randn(2, 8))["loss"] > 0  # nothing was lost: the trainer still works


class WithIntParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.count = torch.nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)


def test_non_floating_parameters_are_named() -> None:
    with pytest.raises(zr.ModelError, match=r"floating point.*'count', torch.int64"):
        zr.ZeroTrainer(WithIntParameter, _loss, config=zr.ZeroConfig(world_size=2))


def _failing_model() -> torch.nn.Module:
    raise ValueError("model_fn exploded on purpose")


def test_model_fn_that_raises_reaches_the_driver_with_its_traceback() -> None:
    with pytest.raises(zr.OwnerError, match="model_fn exploded on purpose") as info:
        zr.ZeroTrainer(_failing_model, _loss, config=zr.ZeroConfig(world_size=2))
    assert "_failing_model" in str(info.value)  # the remote traceback names the user's frame


def _loss_failing_on_rank_1(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if batch.shape[0] == 6:  # 13 samples split 7/6: only rank 1 sees 6
        raise RuntimeError("loss_fn failed on one rank")
    return module(batch).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 2])
def test_loss_fn_failing_on_one_rank_is_raised_without_waiting_for_the_blocked_peer(stage: int) -> None:
    trainer = zr.ZeroTrainer(_model, _loss_failing_on_rank_1,
                             config=zr.ZeroConfig(stage=stage, world_size=2, collective_timeout_s=600))
    try:
        with pytest.raises(zr.OwnerError, match="loss_fn failed on one rank") as info:
            trainer.step(torch.randn(13, 8))
        assert info.value.rank == 1
        assert "Remote traceback" in str(info.value) and "_loss_failing_on_rank_1" in str(info.value)
    finally:
        trainer.shutdown()


def _vector_loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).pow(2).mean(dim=1)


def test_a_loss_that_is_not_a_scalar_is_a_model_error() -> None:
    with zr.ZeroTrainer(_model, _vector_loss, config=zr.ZeroConfig(world_size=2)) as trainer:
        with pytest.raises(zr.ModelError, match=r"scalar tensor .* got \(4,\)"):
            trainer.step(torch.randn(8, 8))
