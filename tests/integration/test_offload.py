"""Optimizer state, and stage-3 parameter shards, on local disk (``Offload(optimizer="nvme",
params="nvme")``) on Ray actors, with Hugging Face GPT-2: the peer copies of that state
(``redundancy="peer"``) are files too; a checkpoint saved with the state on disk resumes with it
in memory at another stage and size, and the reverse, all equal to the run that never offloaded;
and an owner SIGKILLed in backward while its optimizer state and parameter shards are on disk is
restored from its peer's copy, the run ending equal to
single-process torch; so is one whose state files the disk changed (a byte flipped through the
file, found by the block checksums before the update used it). The stage x optimizer matrix is on thread ranks
(tests/unit/test_offload_threads.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
import torch

import zero_ray as zr
from disk_faults import corrupt_state
from faults import run_with_kill
from finetune_models import causal_lm_loss, gpt2_lm, token_batches
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")
STEPS, SAVE_AT = 4, 2
OPT = zr.AdamW(lr=1e-2, weight_decay=0.1)
BATCHES = token_batches(steps=SAVE_AT + 4, n=6)  # the tiers' test: saved at 2, resumed to 4, saved, resumed to 6


def _peer_copies_where_the_state_is(trainer: zr.ZeroTrainer, offload: zr.Offload) -> None:
    for r in trainer.memory_report():
        if offload.optimizer_on_nvme:
            assert r["nvme"] > 0 and r["redundancy_nvme"] > 0 and r["redundancy_host"] == 0, r
        else:
            assert r["nvme"] == r["redundancy_nvme"] == 0 < r["redundancy_host"], r


def _save(tmp_path: Path, name: str, *, before: zr.Offload) -> str:
    """The first two steps at stage 2 on 2 owners with the state where ``before`` puts it, then a save."""
    trainer = zr.ZeroTrainer(gpt2_lm, causal_lm_loss, optimizer=OPT,
                             config=zr.ZeroConfig(stage=2, world_size=2, device="cpu", offload=before,
                                                  elastic=zr.ElasticConfig(redundancy="peer")))
    try:
        for batch in BATCHES[:SAVE_AT]:
            trainer.step(batch)
        _peer_copies_where_the_state_is(trainer, before)
        return str(trainer.save_checkpoint(tmp_path / name, wait=True))
    finally:
        trainer.shutdown()


def _resume(saved: list[str], *, at: int, stage: int, world_size: int, after: zr.Offload,
            save: Path | None = None) -> tuple[list[dict[str, torch.Tensor]], str | None]:
    """Each checkpoint in ``saved`` (all at step ``at``) resumed at ``stage`` on ``world_size``
    owners with the state where ``after`` puts it, and two steps run: the first through
    ``from_checkpoint``, each next one loaded into the same trainer (one pool's start for several
    checkpoints: this test's cost). With ``save``, the last one's state is saved there too, the
    next resume's source (a pool that both resumes and saves: fewer pools started)."""
    resumed = zr.ZeroTrainer.from_checkpoint(saved[0], gpt2_lm, causal_lm_loss, optimizer=OPT,
                                             config=zr.ZeroConfig(stage=stage, world_size=world_size, device="cpu",
                                                                  offload=after,
                                                                  elastic=zr.ElasticConfig(redundancy="peer")))
    out = []
    try:
        for k, path in enumerate(saved):
            if k:
                assert resumed.load_checkpoint(path) == at
            for batch in BATCHES[at:at + 2]:
                resumed.step(batch)
            assert all((r["nvme"] > 0) == after.any_on_nvme for r in resumed.memory_report())
            out.append(resumed.full_state_dict())
        if save is None:
            return out, None
        _peer_copies_where_the_state_is(resumed, after)
        return out, str(resumed.save_checkpoint(save, wait=True))
    finally:
        resumed.shutdown()


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_across_tiers(tmp_path: Path) -> None:
    disk = zr.Offload(optimizer="nvme", path=str(tmp_path / "nvme"))
    everything = zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path / "nvme"))  # stage 3's shards too
    memory = zr.Offload()
    memory2 = _save(tmp_path, "memory2", before=memory)
    disk2 = _save(tmp_path, "disk2", before=disk)
    # A checkpoint saved from disk goes through from_checkpoint (the path under test); the run that
    # never offloaded is loaded into the same pool after it, its reference. The stage-3 pools on 3
    # owners then save step 4, in memory and with everything on disk, and those two resume at
    # stage 2 on 2 owners: five pools, not seven.
    (disk_to_memory, ref_23), memory3 = _resume([disk2, memory2], at=SAVE_AT, stage=3, world_size=3, after=memory,
                                                save=tmp_path / "memory3")
    (memory_to_everything,), everything3 = _resume([memory2], at=SAVE_AT, stage=3, world_size=3, after=everything,
                                                   save=tmp_path / "everything3")
    assert memory3 is not None and everything3 is not None
    (everything_to_memory, ref_32), _ = _resume([everything3, memory3], at=SAVE_AT + 2, stage=2, world_size=2,
                                                after=memory)
    for got, ref, what in ((disk_to_memory, ref_23, "optimizer on disk at stage 2 -> memory at stage 3"),
                           (memory_to_everything, ref_23, "memory at stage 2 -> everything on disk at stage 3"),
                           (everything_to_memory, ref_32, "everything on disk at stage 3 -> memory at stage 2")):
        assert max(float((got[n] - ref[n]).abs().max()) for n in ref) == 0.0, what
    assert not os.listdir(tmp_path / "nvme")  # the owners' files went with them


@pytest.mark.timeout(300)
def test_an_owner_killed_with_its_state_on_disk_is_restored_from_its_peer(tmp_path: Path) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    batches = token_batches(steps=6, n=6)
    ref, _ = single_process(gpt2_lm, causal_lm_loss, opt, batches)
    config = zr.ZeroConfig(stage=3, world_size=3, device="cpu", health_interval_s=0.2, health_timeout_s=5.0,
                           collective_timeout_s=600,
                           offload=zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path / "nvme")),
                           elastic=zr.ElasticConfig(redundancy="peer"))
    (tmp_path / "marks").mkdir()
    run = run_with_kill("backward", model_fn=gpt2_lm, loss_fn=causal_lm_loss, optimizer=opt, batches=batches,
                        config=config, at=3, marks=str(tmp_path / "marks"))
    print("; ".join(r.summary() for r in run.recoveries))
    assert [r.outcome.value for r in run.recoveries] == ["restored"] and 1 in run.recoveries[0].lost
    assert max(float((run.params[n] - ref[n]).abs().max()) for n in ref) <= 1e-6


@pytest.mark.timeout(300)
def test_an_owner_whose_state_the_disk_changed_is_treated_as_lost_and_restored_from_its_peer(tmp_path: Path) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    batches = token_batches(steps=5, n=6)
    ref, _ = single_process(gpt2_lm, causal_lm_loss, opt, batches)
    nvme = str(tmp_path / "nvme")
    config = zr.ZeroConfig(stage=2, world_size=3, device="cpu", offload=zr.Offload(optimizer="nvme", path=nvme),
                           elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(gpt2_lm, causal_lm_loss, optimizer=opt, config=config) as trainer:
        for batch in batches[:2]:
            trainer.step(batch)
        pid = ray.get(trainer.actors[1].node.remote(), timeout=60)["pid"]
        assert corrupt_state(pid, rank=1, directory=nvme) >= 1  # between two steps, as a failing disk would
        for batch in batches[2:]:
            trainer.step(batch)
        got = trainer.full_state_dict()
        (report,) = trainer.recoveries
    print(report.summary(), report.error)
    assert report.outcome.value == "restored" and report.lost == {1: "its optimizer state on disk failed a checksum"}
    assert "StateCorruptError" in report.error or "fail their checksum" in report.error
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-6


@pytest.mark.timeout(300)
def test_a_run_with_its_parameters_on_disk_grows_and_shrinks_as_the_run_in_memory(tmp_path: Path) -> None:
    # The resize's transfer reads each rank's shards out of its files and writes the new ranks' in.
    opt = zr.AdamW(lr=1e-2, weight_decay=0.1)
    batches = token_batches(steps=5, n=6)
    runs = {}
    for name, offload in (("memory", zr.Offload()),
                          ("disk", zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path / "nvme")))):
        config = zr.ZeroConfig(stage=3, world_size=2, device="cpu", offload=offload)
        with zr.ZeroTrainer(gpt2_lm, causal_lm_loss, optimizer=opt, config=config) as trainer:
            for step, batch in enumerate(batches):
                if step in (2, 4):
                    assert trainer.resize({2: 3, 4: 2}[step])["world_size"] == {2: 3, 4: 2}[step]
                trainer.step(batch)
            assert all((r["nvme"] > 0) == offload.any_on_nvme for r in trainer.memory_report())
            runs[name] = trainer.full_state_dict()
    assert max(float((runs["disk"][n] - runs["memory"][n]).abs().max()) for n in runs["memory"]) == 0.0


@pytest.mark.timeout(300)
def test_a_resume_without_config_keeps_offload_peer_redundancy_and_the_checkpoint_dir(tmp_path: Path) -> None:
    """The whole run comes back from its checkpoint: its state stays on disk, its peer copies are
    kept, a save without a path goes to its checkpoint dir, and it ends as the run never stopped."""
    opt = zr.AdamW(lr=1e-2, weight_decay=0.1)
    batches = token_batches(steps=STEPS, n=6)
    config = zr.ZeroConfig(stage=2, world_size=2, device="cpu", offload=zr.Offload(optimizer="nvme",
                                                                                   path=str(tmp_path / "nvme")),
                           elastic=zr.ElasticConfig(redundancy="peer"),
                           checkpoint=zr.CheckpointConfig(dir=str(tmp_path / "ckpt"), keep=5))

    def train(trainer: zr.ZeroTrainer, part: list[torch.Tensor]) -> None:
        for batch in part:
            trainer.step(batch)
        for r in trainer.memory_report():  # optimizer state and its peer copy on disk, not in memory
            assert r["nvme"] > 0 and r["redundancy_nvme"] > 0 and r["redundancy_host"] == 0, r

    # The uninterrupted run is the saving one going on after its committed save (as test_checkpoint's
    # save_midway): one pool fewer to start than a separate run.
    first = zr.ZeroTrainer(gpt2_lm, causal_lm_loss, optimizer=opt, config=config)
    try:
        train(first, batches[:SAVE_AT])
        saved = first.save_checkpoint(wait=True)  # into checkpoint.dir
        train(first, batches[SAVE_AT:])
        ref = first.full_state_dict()
    finally:
        first.shutdown()
    assert zr.ZeroTrainer.saved_config(saved) == config
    resumed = zr.ZeroTrainer.from_checkpoint(saved, gpt2_lm, causal_lm_loss, optimizer=opt)
    try:
        assert resumed.config == config and resumed.step_count == SAVE_AT
        train(resumed, batches[SAVE_AT:])
        again = resumed.save_checkpoint(wait=True)  # the restored checkpoint dir, not a default
        got = resumed.full_state_dict()
    finally:
        resumed.shutdown()
    assert os.path.dirname(again) == str(tmp_path / "ckpt") and again.endswith(f"step-{STEPS:08d}")
    assert max(float((got[n] - ref[n]).abs().max()) for n in ref) == 0.0
