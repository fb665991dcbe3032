"""Offload with tensor parallelism on thread ranks (issue 45): optimizer state on disk
(``Offload(optimizer="nvme")``) at stages 1 and 2, and with stage 3's parameter shards too
(``params="nvme"``), at (T, D) = (2, 2) is the in-memory TP run bit for bit: each owner streams
its own TP shard's ZeRO partition through the update as at T = 1. The Llama of tp_llama.py under
its own plan, AdamW with clipping engaged."""

from __future__ import annotations

from pathlib import Path

import pytest

import zero_ray as zr
from thread_ranks import run_tp_ranks
from tp_llama import CLIP, OPTIMIZERS, batches, llama, lm_loss

STEPS = 3


@pytest.mark.parametrize(("stage", "params"), [(1, None), (2, None), (3, "nvme")])
def test_offloaded_tp_run_is_the_in_memory_tp_run(stage: int, params: str | None, tmp_path: Path) -> None:
    opt = OPTIMIZERS["adamw"]
    ref, ref_losses, _, _ = run_tp_ranks(2, 2, llama, lm_loss, opt, batches(STEPS), stage=stage, clip=CLIP)
    offload = zr.Offload(optimizer="nvme", params=params, path=str(tmp_path))
    got, losses, engines, _ = run_tp_ranks(2, 2, llama, lm_loss, opt, batches(STEPS), stage=stage, clip=CLIP,
                                           offload=offload)
    assert got.keys() == ref.keys()
    assert all(bool((got[k] == ref[k]).all()) for k in ref)
    assert losses == ref_losses
    for engine in engines:
        report = engine.memory_report()
        moments = [t for g in engine.state.groups for t in g.moments.values()]
        files = engine.state.state_files
        assert moments and files is not None and all(files.holds(t) for t in moments)
        # the rank's TP slice's partition in files: its moments, and at stage 3 its master and
        # gradient shards
        sharded = [g for g in engine.state.groups if g.param_files is not None]
        assert bool(sharded) == (params == "nvme")
        want = sum(4 * t.numel() for t in moments) + 2 * sum(4 * g.shard.numel() for g in sharded)
        assert report["nvme"] == want > 0
