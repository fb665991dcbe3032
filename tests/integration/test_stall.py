"""A step that stalls while every owner is alive: one owner's ``loss_fn`` blocks in user code
(without the GIL, so its heartbeats go on), once, on that rank only. At ``step_timeout_s`` the
driver reads every owner's flight record: the error names the blocked rank as in compute and
the other as waiting in a named collective with its sequence number; the blocked owner, and only
it, is treated as lost; the run recovers within ``step_timeout_s`` + 15 s and ends equal to the
uninterrupted run."""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import zero_ray as zr
from zero_ray.models import mlp
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

MLP_FN = functools.partial(mlp, 16, 3)
# The stall is waited out once, at the step timeout: 10 s is still a hundred times a step here.
STEPS, STALL_AT, STEP_TIMEOUT_S = 4, 2, 10.0
MARK = -77.0


def _loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(module(batch[0]), batch[1])


def blocks_once(module: torch.nn.Module, batch: Any, *, marks: str) -> torch.Tensor:
    """The MSE loss; the owner whose piece starts with the marker blocks first (once: a file
    records it), in user code that releases the GIL, for longer than the step timeout."""
    x = batch[0]
    if x.shape[0] and float(x[0, 0]) == MARK:
        try:
            os.close(os.open(os.path.join(marks, "blocked"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            threading.Event().wait(10 * STEP_TIMEOUT_S)  # the stall; the recovery SIGKILLs this process
    return _loss(module, batch)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(STEPS)]
    out[STALL_AT][0][4, 0] = MARK  # the first sample of rank 1's piece (8 samples over 2 owners)
    return out


def test_a_stalled_rank_is_named_and_only_it_is_replaced(tmp_path: Path) -> None:
    batches = _batches()
    opt = zr.SGD(lr=0.05, momentum=0.9)
    config = zr.ZeroConfig(stage=2, world_size=2, bucket_bytes=4096, step_timeout_s=STEP_TIMEOUT_S,
                           collective_timeout_s=120.0, health_interval_s=0.2, health_timeout_s=3.0,
                           elastic=zr.ElasticConfig(redundancy="peer"))
    trainer = zr.ZeroTrainer(MLP_FN, functools.partial(blocks_once, marks=str(tmp_path)), optimizer=opt,
                             config=config)
    live: list[tuple[str, ...]] = []
    stepped = threading.Event()

    def ask_while_stalled() -> None:  # what `zero-ray status --flight` asks, while the step hangs
        deadline = time.monotonic() + STEP_TIMEOUT_S + 60  # the steps before the stall, then the stall
        while not stepped.is_set() and time.monotonic() < deadline:
            if (tmp_path / "blocked").exists():
                lines = trainer.job_status(flight=True).flight
                if lines and lines[0].startswith("rank(s) [1] diverged"):
                    live.append(lines)
                    return
            time.sleep(0.2)  # polling a live run, bounded in time

    asker = threading.Thread(target=ask_while_stalled, daemon=True)
    try:
        seconds = []
        asker.start()
        for b in batches:
            t0 = time.monotonic()
            trainer.step(b)
            seconds.append(time.monotonic() - t0)
        got = trainer.full_state_dict()
        reports = list(trainer.recoveries)
    finally:
        stepped.set()
        trainer.shutdown()
    print(f"step seconds {[round(s, 2) for s in seconds]}; stall:\n{reports[0].stall if reports else None}")
    assert (tmp_path / "blocked").exists()  # the fault fired
    assert [(sorted(r.lost), r.outcome.value) for r in reports] == [([1], "restored")]
    stall = reports[0].stall
    head = re.match(r"rank\(s\) \[1\] diverged: not in (\w+) #(\d+) on (\S+), which ranks \[0\] wait in", stall)
    assert head, stall
    op, seq, group = head.groups()
    assert re.search(r"rank 1: in forward \(step 3, micro-batch 0\) for \d+\.\ds, in no collective", stall), stall
    assert re.search(rf"rank 0: waiting in {op} #{seq} on {re.escape(group)} \(\d+ bytes\) for \d+\.\ds", stall), stall
    assert seconds[STALL_AT] <= STEP_TIMEOUT_S + 15, seconds
    asker.join(1)
    assert live and any(line.startswith("rank 1: in forward (step 3") for line in live[0]), live
    ref, _ = single_process(MLP_FN, _loss, opt, batches)
    assert max(float((got[n] - ref[n]).abs().max()) for n in got) <= 1e-6
