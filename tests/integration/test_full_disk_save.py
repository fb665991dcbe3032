"""A full disk under a save (issue 46, the soak's ``full_disk`` fault on the cheapest setup): a
local checkpoint root on a 4 MiB tmpfs filled to all but 8 KiB. The save is refused with a
CheckpointError naming the disk's error, nothing of it is visible (no committed checkpoint,
``latest`` unchanged, no unfinished directory left), no callback hears of it, and the run goes on
to the same weights as one process; once room is freed the next save commits. Root only (mount)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import zero_ray as zr
from benchmarks.harness.full_disk import fill, mount_tmpfs, unmount, visible
from zero_ray.errors import CheckpointError
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = [pytest.mark.usefixtures("ray_session"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]

GPT_FN = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(46)
    return [torch.randint(0, 64, (8, 17), generator=g) for _ in range(n)]


def test_a_save_onto_a_full_disk_is_refused_invisibly_and_the_run_goes_on(tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    mount_tmpfs(disk, size_bytes=4 << 20)
    heard: list[int] = []

    class Heard(zr.Callback):
        def on_checkpoint(self, path: str, step: int) -> None:
            heard.append(step)

    data, opt = batches(5), zr.SGD(lr=0.1)
    root = os.path.join(disk, "run")
    try:
        with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=opt, callbacks=[Heard()],
                            config=zr.ZeroConfig(stage=2, world_size=2, bucket_bytes=4096)) as trainer:
            for b in data[:2]:
                trainer.step(b)
            first = trainer.save_checkpoint(root, wait=True)
            before = visible(root)
            assert before.committed == (os.path.basename(first),) and before.latest == before.committed[0]
            filler = fill(disk, leave_bytes=8 << 10)
            trainer.step(data[2])
            with pytest.raises(CheckpointError, match="No space left on device"):
                trainer.save_checkpoint(root, wait=True)
            assert visible(root) == before  # nothing committed, latest unchanged, no unfinished directory
            assert heard == [2]
            for b in data[3:]:  # the run goes on on the same owners
                trainer.step(b)
            assert trainer.world_size == 2 and trainer.step_count == 5 and not trainer.recoveries
            filler.unlink()
            again = trainer.save_checkpoint(root, wait=True)
            assert visible(root).latest == os.path.basename(again) and heard == [2, 5]
            got = trainer.full_state_dict()
    finally:
        unmount(disk)
    ref, _ = single_process(GPT_FN, lm_loss, opt, data)
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) < 1e-6
