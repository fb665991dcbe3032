"""fit() sends each step to the owners while the one before runs (issue 32 item 8): the run
still equals one process, every step's metrics arrive in order, a call between steps collects
the step in flight first, and an owner SIGKILLed with a step in flight is recovered exactly."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

import zero_ray as zr
from fit_order import reference_block_indices, token_windows
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
GPT_FN = functools.partial(GPT, CFG)
SEQ, BATCH, SEED, WINDOW, BLOCK = 8, 6, 5, 2, 64
OPT = zr.SGD(lr=0.1, momentum=0.9)


def corpus(directory: Path, steps: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """Token files and the single-process result of ``steps`` steps in the documented order."""
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, size=2400).astype("<u2")
    tokens.tofile(directory / "train-0.bin")
    samples = (len(tokens) - 1) // SEQ
    per = BLOCK // SEQ
    sizes = [per] * (samples // per) + ([samples % per] if samples % per else [])
    order = reference_block_indices(sizes, global_batch_size=BATCH, steps=steps, seed=SEED, window=WINDOW)
    ref, _ = single_process(GPT_FN, lm_loss, OPT, [token_windows(tokens, SEQ, idx) for idx in order])
    source = zr.data.TokenFiles(str(directory / "train-*.bin"), seq_len=SEQ, block_tokens=BLOCK, window=WINDOW)
    return source, ref


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_pipelined_steps_equal_one_process_and_a_call_between_them_collects_the_one_in_flight(tmp_path: Path) -> None:
    source, ref = corpus(tmp_path, 10)
    seen: list[tuple[int, bool]] = []
    reports: list[int] = []
    cfg = zr.ZeroConfig(stage=2, world_size=2, bucket_bytes=4096)
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=OPT, config=cfg) as trainer:

        def callback(metrics: dict[str, Any]) -> None:
            seen.append((metrics["step"], metrics["sent_ahead"]))
            if metrics["step"] in (3, 6):  # step 4 (7) is in flight: the report collects it first
                reports.append(len(trainer.memory_report()))
                reports.append(trainer.step_count)

        result = trainer.fit(source, global_batch_size=BATCH, steps=10, seed=SEED, progress=False, callback=callback)
        got = trainer.full_state_dict()
        assert trainer.step_count == 10 and not trainer.recoveries
    assert result["step"] == 10 and result["steps_run"] == 10
    assert [s for s, _ in seen] == list(range(1, 11))  # every step's metrics, in order
    # Sent alone: the first, and each after one a report collected; the rest while one ran.
    assert [s for s, ahead in seen if not ahead] == [1, 5, 8]
    assert reports == [2, 4, 2, 7]  # the report counted the step it collected
    assert max_dev(got, ref) <= 1e-6


def test_an_owner_sigkilled_with_a_step_in_flight_is_recovered_exactly(tmp_path: Path) -> None:
    source, ref = corpus(tmp_path, 9)
    # Snapshots every other step: the steps after a snapshot are sent alone, the others ahead.
    cfg = zr.ZeroConfig(stage=3, world_size=3, bucket_bytes=4096, health_interval_s=0.2, health_timeout_s=3.0,
                        elastic=zr.ElasticConfig(redundancy="peer", snapshot_every=2))
    seen: list[tuple[int, bool]] = []
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=OPT, config=cfg) as trainer:
        pid = ray.get(trainer.actors[2].node.remote(), timeout=30)["pid"]

        def kill_after_step_5(metrics: dict[str, Any]) -> None:
            seen.append((metrics["step"], metrics["sent_ahead"]))
            if metrics["step"] == 5:  # step 6 was sent while step 5 ran: it is in flight now
                os.kill(pid, signal.SIGKILL)

        trainer.fit(source, global_batch_size=BATCH, steps=9, seed=SEED, progress=False, callback=kill_after_step_5)
        assert [sorted(r.lost) for r in trainer.recoveries] == [[2]]
        assert trainer.recoveries[0].failed_step == 5  # found collecting step 6, sent while step 5 ran
        got = trainer.full_state_dict()
    assert [s for s, _ in seen] == list(range(1, 10))
    # Sent ahead: each step after one without a snapshot, until the loss; then the run is below
    # its size and a grow back may come at any boundary, so each step is sent alone.
    assert [s for s, ahead in seen if ahead] == [2, 4]
    assert max_dev(got, ref) <= 1e-6
