"""Optimizer state, and stage-3 parameter shards, on local disk (``Offload(optimizer="nvme",
params="nvme")``) on thread ranks: the same run
bit for bit at every stage, with SGD and AdamW, on Hugging Face GPT-2 built from a config, in
bf16 and with a frozen base (PEFT); the state really in files (the memory report's ``nvme``);
owners sharing a directory; and the refusals: an unwritable path, a full disk (before any
step), whole-tensor optimizers, ``optimizer="cpu"``; and a state file changed on disk between
two updates, caught by its block checksums before the update would use it."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_ray as zr
from disk_faults import corrupt_state, flip_byte, state_mappings
from finetune_models import causal_lm_loss, lora_gpt2, token_batches
from test_activation_checkpointing import gpt2
from test_optimizers_threads import adamw_rest, llama, llama_loss, muon
from test_units_threads import _max_dev
from thread_ranks import run_ranks
from zero_ray.errors import ConfigError, ResourceError, StateCorruptError
from zero_ray.owner.tensors import state_files as owner_offload
from zero_ray.owner.tensors.state_files import BLOCK_BYTES, StateFiles
from zero_ray.owner.step.optimizer import ShardOptimizer
from zero_ray.owner.step.param_group import ParamGroup
from zero_ray.owner.step.state_stream import StateStream

OPTIMIZERS = {"adamw": lambda: zr.AdamW(lr=1e-2, weight_decay=0.1), "sgd": lambda: zr.SGD(lr=0.1, momentum=0.9)}


def _gpt2() -> torch.nn.Module:
    return gpt2(dropout=0.0)


def _nvme(path: Path) -> zr.Offload:
    return zr.Offload(optimizer="nvme", path=str(path))


def _fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every later reservation of a state file fails with ENOSPC; the lengths asked for."""
    calls: list[int] = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(owner_offload.os, "posix_fallocate", full)
    return calls


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("stage", "world_size"), [(0, 2), (1, 1), (1, 3), (2, 2), (3, 1), (3, 3)])
def test_offloaded_run_is_the_in_memory_run(stage: int, world_size: int, optimizer: str, tmp_path: Path) -> None:
    batches = token_batches()
    ref, _, _ = run_ranks(world_size, _gpt2, causal_lm_loss, OPTIMIZERS[optimizer](), batches, stage=stage)
    got, engines, _ = run_ranks(world_size, _gpt2, causal_lm_loss, OPTIMIZERS[optimizer](), batches, stage=stage,
                                offload=_nvme(tmp_path))
    assert _max_dev(got, ref) == 0.0
    for engine in engines:
        report = engine.memory_report()
        moments = [t for g in engine.state.groups for t in g.moments.values()]
        files = engine.state.groups[0].state_files
        assert files is not None and moments and all(files.holds(t) for t in moments)
        # every moment in files, its padding too (the report counts padding apart)
        assert report["nvme"] == sum(4 * t.numel() for t in moments) >= report["optimizer_moments"] > 0
        assert report["resident"] == report["total"] - report["nvme"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("world_size", "tiers"), [(1, ("nvme", "nvme")), (3, ("nvme", "nvme")), (2, (None, "nvme"))])
def test_parameters_on_disk_at_stage_3_are_the_in_memory_run(world_size: int, tiers: tuple[str | None, str],
                                                             optimizer: str, tmp_path: Path) -> None:
    batches = token_batches()
    ref, _, _ = run_ranks(world_size, _gpt2, causal_lm_loss, OPTIMIZERS[optimizer](), batches, stage=3)
    offload = zr.Offload(optimizer=tiers[0], params=tiers[1], path=str(tmp_path))
    got, engines, _ = run_ranks(world_size, _gpt2, causal_lm_loss, OPTIMIZERS[optimizer](), batches, stage=3,
                                offload=offload, prefetch_depth=2)
    assert _max_dev(got, ref) == 0.0
    for engine in engines:
        report = engine.memory_report()
        sharded = [g for g in engine.state.groups if g.param_files is not None]
        files = engine.state.state_files
        assert sharded and files is not None and all(files.holds(g.shard) for g in sharded)
        moments = [t for g in engine.state.groups for t in g.moments.values()] if tiers[0] else []
        # the report is the step's: every sharded group's fp32 shard (its master) and its gradient
        # shard in files, padding included; persistent groups stay in memory
        assert report["nvme"] == 2 * sum(4 * g.shard.numel() for g in sharded) + sum(4 * t.numel() for t in moments)
        assert report["resident"] == report["total"] - report["nvme"] > 0


def test_parameters_on_disk_with_bf16_and_a_frozen_base(tmp_path: Path) -> None:
    batches = token_batches()
    opt = zr.AdamW(lr=1e-2)
    offload = zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path))
    for model_fn, dtype in ((_gpt2, "bfloat16"), (lora_gpt2, "float32")):
        ref, _, _ = run_ranks(2, model_fn, causal_lm_loss, opt, batches, stage=3, dtype=dtype)
        got, _, _ = run_ranks(2, model_fn, causal_lm_loss, opt, batches, stage=3, dtype=dtype, offload=offload)
        assert _max_dev(got, ref) == 0.0, (model_fn, dtype)


def test_a_parameter_shard_the_disk_changed_stops_the_gather(tmp_path: Path) -> None:
    batches = token_batches(steps=3)
    offload = zr.Offload(params="nvme", path=str(tmp_path))
    _, (engine,), _ = run_ranks(1, _gpt2, causal_lm_loss, zr.SGD(lr=0.1), batches[:2], stage=3, offload=offload)
    before = torch.cat([v for _, (_, _, v) in sorted(engine.master_fragments().items())])
    flipped = corrupt_state(os.getpid(), rank=0, directory=str(tmp_path))  # a byte of each shard's file
    assert flipped == sum(g.param_files is not None for g in engine.state.groups) >= 2
    with pytest.raises(StateCorruptError, match=r"rank 0: the parameter shard of bucket \d+ .* fail their checksum"):
        engine.step(batches[2], global_samples=len(batches[2]))
    after = torch.cat([v for _, (_, _, v) in sorted(engine.master_fragments().items())])
    # stopped in the forward's first gather: no update ran, only the flipped bytes' values differ
    assert int((after != before).sum()) == flipped


def test_a_full_disk_in_a_step_fails_it_and_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = token_batches(steps=2)
    offload = zr.Offload(optimizer="nvme", params="nvme", path=str(tmp_path))
    _, (engine,), _ = run_ranks(1, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), batches[:1], stage=3, offload=offload)
    before = {n: v.clone() for n, (_, _, v) in engine.master_fragments().items()}
    calls = _fill_the_disk(monkeypatch)
    with pytest.raises(ResourceError, match=r"rank 0's offloaded state needs \d+ more bytes .* disk is full"):
        engine.step(batches[1], global_samples=len(batches[1]))
    assert calls  # the fault fired: the step's gradient shards could not be reserved
    after = engine.master_fragments()
    assert all(torch.equal(after[n][2], before[n]) for n in before)


def test_the_first_group_is_read_while_the_step_computes_and_each_group_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = token_batches(steps=2)
    _, (engine,), _ = run_ranks(1, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), batches[:1], stage=1,
                                offload=_nvme(tmp_path))
    events: list[tuple[str, int]] = []
    optimizer = engine.state.optimizer
    for name, cls in (("populate_state", ParamGroup), ("read_ahead", StateStream), ("step", ShardOptimizer)):
        original = getattr(cls, name)

        def record(self: object, *args: object, _original: Any = original, _name: str = name) -> Any:
            events.append((_name, self.index if isinstance(self, ParamGroup) else -1))
            return _original(self, *args)

        monkeypatch.setattr(cls, name, record)
    engine.step(batches[1], global_samples=len(batches[1]))
    order = optimizer.stream_order
    assert len(order) >= 3
    # the read-ahead was asked for before the update began, and nobody read its group again
    assert [e for e in events if e[0] != "populate_state"] == [("read_ahead", -1), ("step", -1)]
    assert sorted(i for name, i in events if name == "populate_state") == sorted(g.index for g in order)


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_with_bf16_and_a_frozen_base(stage: int, tmp_path: Path) -> None:
    batches = token_batches()
    opt = zr.AdamW(lr=1e-2)
    for model_fn, dtype in ((_gpt2, "bfloat16"), (lora_gpt2, "float32")):
        ref, _, _ = run_ranks(2, model_fn, causal_lm_loss, opt, batches, stage=stage, dtype=dtype)
        got, _, _ = run_ranks(2, model_fn, causal_lm_loss, opt, batches, stage=stage, dtype=dtype,
                              offload=_nvme(tmp_path))
        assert _max_dev(got, ref) == 0.0, (model_fn, dtype)


def test_owners_sharing_a_path_leave_nothing_there(tmp_path: Path) -> None:
    _, engines, _ = run_ranks(3, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), token_batches(steps=1), stage=1,
                              offload=_nvme(tmp_path))
    assert all(e.memory_report()["nvme"] > 0 for e in engines)
    assert not os.listdir(tmp_path)  # every file unlinked once created: no names to collide on or clean up


def test_an_unwritable_path_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"Offload\(path='.*a-file/state'\).*writable directory"):
        run_ranks(1, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), token_batches(steps=1), stage=1,
                  offload=zr.Offload(optimizer="nvme", path=str(blocker / "state")))


def test_a_full_disk_fails_the_start_not_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fill_the_disk(monkeypatch)
    with pytest.raises(ResourceError, match=r"rank 0's offloaded state needs \d+ more bytes .* disk is full"):
        run_ranks(1, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), token_batches(steps=1), stage=1,
                  offload=_nvme(tmp_path))
    assert calls  # the fault fired, while the owner was built (run_ranks takes no step before that)


def test_state_files_hold_zeros_and_survive_eviction(tmp_path: Path) -> None:
    files = StateFiles(str(tmp_path), rank=4)
    t = files.zeros(3 * 4096)
    assert files.holds(t) and float(t.abs().sum()) == 0.0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    files.evict(t)
    files.populate(t)
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))
    assert files.zeros(0).numel() == 0


def test_a_block_changed_on_disk_is_named_by_its_checksum(tmp_path: Path) -> None:
    files = StateFiles(str(tmp_path), rank=5)
    t = files.zeros(3 * BLOCK_BYTES // 4)  # three blocks
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    files.verify(t, what="unsealed")  # no checksums yet: nothing to compare
    files.seal(t)
    files.evict(t)
    files.verify(t, what="intact")
    ((start, end),) = state_mappings(os.getpid(), rank=5, directory=str(tmp_path))
    flip_byte(os.getpid(), start, end, offset=BLOCK_BYTES + 7)  # through the file, not the tensor
    with pytest.raises(StateCorruptError, match=rf"rank 5: moment x \({3 * BLOCK_BYTES} bytes .*1 of 3 blocks fail "
                                                rf"their checksum, the first bytes \[{BLOCK_BYTES}, {2 * BLOCK_BYTES}\)"):
        files.verify(t, what="moment x")
    assert files.zeros(t.numel()).data_ptr() != t.data_ptr()  # (a new buffer starts with no checksums)


@pytest.mark.parametrize("stage", [1, 3])
def test_an_update_stops_before_using_state_the_disk_changed(stage: int, tmp_path: Path) -> None:
    batches = token_batches(steps=3)
    _, (engine,), _ = run_ranks(1, _gpt2, causal_lm_loss, zr.AdamW(lr=1e-2), batches[:2], stage=stage,
                                offload=_nvme(tmp_path))
    before = {n: v.clone() for n, (_, _, v) in engine.master_fragments().items()}
    assert corrupt_state(os.getpid(), rank=0, directory=str(tmp_path)) >= 2  # exp_avg and exp_avg_sq at least
    with pytest.raises(StateCorruptError, match=r"rank 0: optimizer state 'exp_avg' of bucket \d+ .* fail their "
                                                r"checksum"):
        engine.step(batches[2], global_samples=len(batches[2]))
    after = engine.master_fragments()  # the first bucket's update was where it stopped: nothing changed
    assert all(torch.equal(after[n][2], before[n]) for n in before)


def test_whole_tensor_optimizers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"torch\.optim\..*Muon steps whole tensors"):
        run_ranks(2, llama, llama_loss, [muon, adamw_rest], token_batches(steps=1), stage=1,
                  offload=_nvme(tmp_path))


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="on CPU owners it already is in host memory.*optimizer='nvme'"):
        zr.Offload(optimizer="cpu")
    with pytest.raises(ConfigError, match="needs path="):
        zr.Offload(optimizer="nvme")
    with pytest.raises(ConfigError, match="is not one of"):
        zr.Offload(optimizer="disk", path="/x")
    with pytest.raises(ConfigError, match="built for CPU owners"):
        zr.ZeroConfig(device="cuda", offload=zr.Offload(optimizer="nvme", path="/x"))
    with pytest.raises(ConfigError, match=r"Offload\(params='cpu'\).*move nothing.*params='nvme'"):
        zr.Offload(params="cpu", path="/x")
    with pytest.raises(ConfigError, match=r"Offload\(params='nvme'\) needs path="):
        zr.Offload(params="nvme")
    with pytest.raises(ConfigError, match=r"params='nvme'\) was given with stage=2.*use stage=3"):
        zr.ZeroConfig(stage=2, offload=zr.Offload(params="nvme", path="/x"))
    with pytest.raises(ConfigError, match="must be a zr.Offload"):
        zr.ZeroConfig(offload="nvme")  # type: ignore[arg-type]
    assert zr.ZeroConfig().offload == zr.Offload()
