"""Callbacks see what a run does: every state change with its cause, each step, each committed
checkpoint and each event; one that raises does not stop the run."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_ray as zr
from zero_ray.errors import ConfigError
from zero_ray.models import mlp, mse_loss

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = functools.partial(mlp, 8, 2)


class Recorder(zr.Callback):
    def __init__(self) -> None:
        self.states: list[tuple[str, str, str]] = []
        self.steps: list[int] = []
        self.checkpoints: list[tuple[str, int]] = []
        self.events: list[str] = []

    def on_state(self, old: zr.RunState, new: zr.RunState) -> None:
        self.states.append((old.value, new.value, new.cause))

    def on_step(self, metrics: Mapping[str, Any], reply: zr.CombinedStep) -> None:
        # every owner's reply, combined: ranks 0 to the pool's size (2, then 3 after the resize)
        assert len(reply.ranks) in (2, 3) and reply.ranks.covers(len(reply.ranks)) and reply.failure is None
        self.steps.append(int(metrics["step"]))

    def on_checkpoint(self, path: str, step: int) -> None:
        self.checkpoints.append((path, step))

    def on_event(self, text: str) -> None:
        self.events.append(text)


class Broken(zr.Callback):
    def on_step(self, metrics: Mapping[str, Any], reply: zr.CombinedStep) -> None:
        raise RuntimeError("an observer's bug")


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


def test_callbacks_see_states_steps_checkpoints_and_events(tmp_path: Path) -> None:
    seen = Recorder()
    config = zr.ZeroConfig(stage=2, world_size=2)
    with zr.ZeroTrainer(MODEL, mse_loss, optimizer=zr.SGD(lr=0.1), config=config,
                        callbacks=[Broken(), seen]) as trainer:
        trainer.step(_batch(0))
        trainer.step(_batch(1))
        saved = trainer.save_checkpoint(str(tmp_path), wait=True)
        trainer.resize(3)
        trainer.step(_batch(2))
    assert seen.steps == [1, 2, 3]  # the broken callback before it did not stop the run or the others
    assert seen.checkpoints == [(saved, 2)]
    assert any("resized 2 -> 3 owners" in e for e in seen.events), seen.events
    assert ("ready", "stepping", "step 1") in seen.states
    assert ("stepping", "ready", "stepping done") in seen.states
    assert ("ready", "resizing", "2 -> 3 owners") in seen.states
    assert seen.states[-1][1] == "shut_down"
    assert trainer.events == [e for e in seen.events]  # the trainer's own log is a callback too


def test_a_callback_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a zr.Callback"):
        zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=1, world_size=1), callbacks=[print])
