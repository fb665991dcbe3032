"""A non-finite step on thread ranks (the owners' side of ``ZeroConfig.on_nonfinite``): a NaN
batch, under "raise" and under "skip", at every stage, leaves every rank bit for bit as the run
that never saw it (parameters, optimizer state, scheduler, BatchNorm statistics, the loss
scale); the result names the ranks; the position moves only for a skip."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import zero_ray as zr
from thread_ranks import run_ranks
from zero_ray.control.handlers import StepResult
from zero_ray.owner.step.engine import OwnerEngine

BATCH, WIDTH = 12, 8
SCHEDULER = zr.WarmupCosine(warmup_steps=2, total_steps=10)


def model() -> nn.Module:
    # BatchNorm: its running statistics are buffers a NaN forward poisons in place.
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, poison = batch
    out = module(x)
    loss = torch.nn.functional.mse_loss(out, y)
    if bool(poison.any()):  # a finite loss whose gradient is NaN: d sqrt(t)/dt at 0 is inf, times 0
        loss = loss + torch.sqrt(0.0 * out.sum())
    return loss


def batches() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g),
             torch.zeros(BATCH, dtype=torch.bool)) for _ in range(4)]


def nan_row(batch: tuple[torch.Tensor, ...], row: int) -> tuple[torch.Tensor, ...]:
    x = batch[0].clone()
    x[row, 0] = float("nan")  # rows 6..11 are rank 1's piece at world size 2
    return (x, *batch[1:])


def poisoned(batch: tuple[torch.Tensor, ...], row: int) -> tuple[torch.Tensor, ...]:
    flags = torch.zeros(BATCH, dtype=torch.bool)
    flags[row] = True
    return (*batch[:2], flags)


def run(stage: int, steps: list[Any], **kw: Any) -> tuple[dict[str, torch.Tensor], list[OwnerEngine],
                                                          list[list[StepResult]]]:
    results: list[list[StepResult]] = []
    full, engines, _ = run_ranks(2, model, loss_fn, zr.AdamW(lr=1e-2), steps, accum=2, clip=0.5, stage=stage,
                                 lr_scheduler=SCHEDULER, results=results, **kw)
    return full, engines, results


def state_of(engine: OwnerEngine) -> dict[str, Any]:
    """Everything of a rank a step may change, as comparable values."""
    opt = engine.state.optimizer
    moments = {(g.index, k): t.clone() for g in engine.state.trainable_groups for k, t in g.moments.items()}
    buffers = {n: b.clone() for n, b in engine.module.state_dict().items() if "running" in n or "num_batches" in n}
    return {"table": opt.table(), "hyper": opt.hyper_state(), "moments": moments, "buffers": buffers,
            "scale": engine.scaler.scale, "growth": engine.scaler.growth_tracker}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def clean() -> dict[int, tuple[dict[str, torch.Tensor], list[dict[str, Any]]]]:
    """Per stage, the run that never saw the bad batch: parameters and each rank's state."""
    out = {}
    for stage in (0, 1, 2, 3):
        full, engines, _ = run(stage, batches())
        out[stage] = (full, [state_of(e) for e in engines])
    return out


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nan_batch_leaves_every_rank_as_the_run_that_never_saw_it(clean: Any, stage: int, policy: str) -> None:
    clean_full, clean_states = clean[stage]
    data = batches()
    full, engines, results = run(stage, [*data[:2], nan_row(data[2], 9), *data[2:]], on_nonfinite=policy)
    bad = [r[2] for r in results]
    assert all(r.skipped and r.refused == (policy == "raise") for r in bad)
    assert {r.nonfinite_loss_ranks for r in bad} == {(1,)}  # rank 1's piece held the NaN row
    # The NaN reaches every parameter's gradient, so every rank's slice of it (at stage 0 every
    # rank holds the whole gradient).
    assert {r.nonfinite_grad_ranks for r in bad} == {(0, 1)}
    assert not any(r.skipped or r.nonfinite_loss_ranks or r.refused for rs in results for r in rs[:2] + rs[3:])
    assert all(math.isfinite(r.totals.loss_sum) for rs in results for r in rs[3:])
    for name in clean_full:
        assert torch.equal(full[name], clean_full[name]), name
    for engine, expected in zip(engines, clean_states):
        assert_same(state_of(engine), expected)
    steps = 4 if policy == "raise" else 5  # a refused step is not a completed one; a skip is
    assert [e.position.step for e in engines] == [steps, steps]
    assert [e.position.samples_seen for e in engines] == [steps * BATCH] * 2


@pytest.mark.parametrize("stage", [1, 3])
def test_a_finite_loss_with_a_nan_gradient_names_no_loss_rank(clean: Any, stage: int) -> None:
    clean_full, _ = clean[stage]
    data = batches()
    full, engines, results = run(stage, [*data[:2], poisoned(data[2], 2), *data[2:]])
    bad = [r[2] for r in results]
    assert all(r.refused and r.nonfinite_loss_ranks == () for r in bad)
    assert {r.nonfinite_grad_ranks for r in bad} == {(0, 1)}
    assert all(torch.equal(full[n], clean_full[n]) for n in clean_full)


def test_float16_refuses_a_nan_loss_but_treats_gradient_overflow_as_the_scaler_does() -> None:
    data = batches()
    _, engines, results = run(2, [data[0], nan_row(data[1], 0)], dtype="float16")
    assert results[0][1].refused and results[0][1].nonfinite_loss_ranks == (0,)
    assert all(e.scaler.scale == 2.0**16 and e.scaler.growth_tracker == 1 for e in engines)  # untouched by it
    # Gradients that overflow from a finite loss: skipped and the scale backs off, whatever on_nonfinite says.
    _, engines, results = run(2, [data[0], poisoned(data[1], 0)], dtype="float16")
    second = [r[1] for r in results]
    assert all(r.skipped and not r.refused and not r.nonfinite_grad_ranks for r in second)
    assert all(e.scaler.scale == 2.0**15 and e.position.step == 2 for e in engines)
