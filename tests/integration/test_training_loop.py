"""The training loop on Ray actors: token-exact loss on padded batches with a Hugging Face Llama,
evaluate(), fit() over a dataset the owners hold (against single-process SGD on the documented
order, through a live resize and a killed owner, and an owner frozen as fit registers its data),
the data path's object store use, and the export that from_pretrained opens."""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
from torch.utils.data import TensorDataset

import zero_ray as zr
from faults import Fault, assert_fired, faulty
from finetune_models import llama, padded_token_batches, token_mean_loss, token_sum_loss
from fit_order import reference_batches
from zero_ray.models import mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

# Every stage x world size runs in the thread tier (tests/unit/*_threads.py); here real actors over
# gloo on a subset that still has every stage and world size in it.
CASES = [(0, 3), (1, 2), (2, 1), (3, 3)]


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize(("stage", "world_size"), CASES)
def test_padded_batches_give_the_single_process_token_mean(stage: int, world_size: int) -> None:
    opt = zr.AdamW(lr=1e-3, weight_decay=0.1)
    batches = padded_token_batches()
    ref, ref_losses = single_process(llama, token_mean_loss, opt, batches)
    trainer = zr.ZeroTrainer(llama, token_sum_loss, optimizer=opt,
                             config=zr.ZeroConfig(stage=stage, world_size=world_size, grad_accum_steps=2))
    try:
        metrics = [trainer.step(b) for b in batches]
        got = trainer.full_state_dict()
    finally:
        trainer.shutdown()
    dev = max_dev(got, ref)
    print(f"token-exact loss, stage {stage} world {world_size} accumulation 2: max |zero - single| = {dev:.3g}")
    assert dev <= 1e-4
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-5)
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert [m["count"] for m in metrics] == tokens and [m["items"] for m in metrics] == tokens


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))


def _pair_mse(module: torch.nn.Module, batch: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return torch.nn.functional.mse_loss(module(x), y, reduction="sum"), y.numel()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_evaluate_is_the_plain_modules_loss_and_changes_nothing(stage: int) -> None:
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g))
    for loss_fn in (mse_loss, _pair_mse):
        trainer = zr.ZeroTrainer(_mlp, loss_fn, optimizer=zr.SGD(lr=0.1),
                                 config=zr.ZeroConfig(stage=stage, world_size=2,
                                                      stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0))
                                                      if stage == 3 else zr.Stage3Config()))
        try:
            trainer.step(batch)
            before = trainer.full_state_dict()
            first, second = trainer.evaluate(batch), trainer.evaluate(batch)
            after = trainer.full_state_dict()
        finally:
            trainer.shutdown()
        plain = _mlp().eval()
        plain.load_state_dict(before)
        with torch.no_grad():
            expected = float(torch.nn.functional.mse_loss(plain(batch[0]), batch[1]))
        assert first == second  # dropout is off and nothing moved
        assert abs(first["loss"] - expected) <= 1e-6
        assert first["samples"] == 10
        assert ("count" in first) is (loss_fn is _pair_mse)
        assert max_dev(before, after) == 0.0


def _dataset(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(21)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def _linear() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


FIT_STEPS, FIT_BATCH, FIT_SEED = 9, 12, 4  # 3 batches an epoch: the run crosses two epoch boundaries


@pytest.mark.parametrize("stage", [1, 3])
def test_fit_matches_single_process_sgd_on_the_documented_order(stage: int) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    dataset = _dataset()
    ref, ref_losses = single_process(_linear, mse_loss, opt, reference_batches(
        dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED))
    seen: list[float] = []
    trainer = zr.ZeroTrainer(_linear, mse_loss, optimizer=opt, config=zr.ZeroConfig(stage=stage, world_size=2))
    try:
        result = trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED, progress=False,
                             callback=lambda m: seen.append(m["loss"]))
        got = trainer.full_state_dict()
    finally:
        trainer.shutdown()
    assert result["step"] == FIT_STEPS and result["epoch"] == 2
    assert max_dev(got, ref) <= 1e-6
    assert seen == pytest.approx(ref_losses, abs=1e-6)


def test_fit_continues_the_order_through_a_resize_and_a_killed_owner() -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    dataset = _dataset()
    ref, _ = single_process(_linear, mse_loss, opt, reference_batches(
        dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED))
    config = zr.ZeroConfig(stage=3, world_size=2, health_interval_s=0.2, health_timeout_s=3.0,
                           elastic=zr.ElasticConfig(redundancy="peer", max_world_size=3))
    trainer = zr.ZeroTrainer(_linear, mse_loss, optimizer=opt, config=config)
    try:
        trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=3, seed=FIT_SEED, progress=False)
        trainer.resize(3)  # the next fit reads on from step 3 with three owners
        pid = ray.get(trainer.actors[1].node.remote(), timeout=30)["pid"]

        def kill_after_step_5(metrics: dict) -> None:  # a real process killed by a signal, mid-run
            if metrics["step"] == 5:
                os.kill(pid, signal.SIGKILL)

        trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED, progress=False,
                    callback=kill_after_step_5)
        got = trainer.full_state_dict()
        recovered = [r.outcome.value for r in trainer.recoveries]
    finally:
        trainer.shutdown()
    assert recovered == ["restored"]
    assert max_dev(got, ref) <= 1e-6


def test_an_owner_frozen_as_fit_registers_its_dataset_is_lost_within_the_health_timeout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The soak's SIGSTOP at the start of a fit chunk waited out init_timeout_s (120 s) there.
    opt = zr.SGD(lr=0.1, momentum=0.9)
    dataset = _dataset()
    ref, _ = single_process(_linear, mse_loss, opt, reference_batches(
        dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED))
    health_timeout_s = 3.0
    freeze = Fault(point="dataset_registration", rank=1, after=1, dir=str(tmp_path), sig="SIGSTOP")  # 2nd fit's
    config = zr.ZeroConfig(stage=2, world_size=2, health_interval_s=0.2, health_timeout_s=health_timeout_s,
                           elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(faulty(_linear, freeze), mse_loss, optimizer=opt, config=config) as trainer:
        trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=3, seed=FIT_SEED, progress=False)
        trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED, progress=False)
        done = time.time()
        got, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
    stopped = assert_fired(freeze)
    assert [(r.call, sorted(r.lost), r.outcome.value) for r in recoveries] == [
        ("registering the train dataset", [1], "restored")], [r.summary() for r in recoveries]
    # lost by its stalled heartbeats, not after init_timeout_s (120 s); room for a loaded machine
    assert recoveries[0].detect_s <= 2 * health_timeout_s, recoveries[0].summary()
    assert done - stopped <= health_timeout_s + 30, f"fit ended {done - stopped:.1f}s after the SIGSTOP"
    assert max_dev(got, ref) <= 1e-6


class Synthetic:
    """``n`` samples of 1024 floats each, computed from the index on demand: the owners build it
    with a factory, so nothing of it is ever on the driver."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(4, generator=g)


def _driver_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_driver_memory_does_not_grow_with_the_dataset() -> None:
    trainer = zr.ZeroTrainer(_linear, mse_loss, optimizer=zr.SGD(lr=0.1), config=zr.ZeroConfig(stage=2, world_size=2))
    try:
        peaks = []
        for n in (10_000, 2_000_000):
            trainer.fit(lambda n=n: Synthetic(n), global_batch_size=16, steps=trainer.step_count + 3, progress=False)
            peaks.append(_driver_peak_rss_mib())
    finally:
        trainer.shutdown()
    # 2M samples of 48 bytes would be ~92 MiB as tensors and far more as Python objects; the
    # driver holds only the epoch's order (4 bytes a sample, ~8 MiB) and the step's indices.
    print(f"driver peak RSS: {peaks[0]:.0f} MiB after 10k samples, {peaks[1]:.0f} MiB after 2M")
    assert peaks[1] - peaks[0] < 40


def test_step_batches_are_freed_from_the_object_store() -> None:
    core = ray._private.worker.global_worker.core_worker  # only to count references in this test
    trainer = zr.ZeroTrainer(_linear, mse_loss, optimizer=zr.SGD(lr=0.1), config=zr.ZeroConfig(stage=1, world_size=2))
    try:
        g = torch.Generator().manual_seed(0)
        counts = []
        for _ in range(6):
            trainer.step((torch.randn(256, 8, generator=g), torch.randn(256, 4, generator=g)))
            counts.append(len(core.get_all_reference_counts()))
    finally:
        trainer.shutdown()
    assert counts[-1] <= counts[1]  # no reference is left behind per step


def test_no_private_ray_api_in_the_data_path() -> None:
    import zero_ray.driver.batch_staging as data
    import zero_ray.driver.trainer as trainer

    for module in (data, trainer):
        source = open(module.__file__, encoding="utf-8").read()
        assert "ray._private" not in source and "remove_object_ref_reference" not in source


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def _gpt2_loss(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return module(input_ids=tokens, labels=tokens).loss


def test_a_stage3_model_exported_opens_with_from_pretrained(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One file, and shards with their index (one pool exports both: its start is this test's cost)."""
    from transformers import GPT2LMHeadModel

    tokens = torch.randint(0, 64, (6, 12), generator=torch.Generator().manual_seed(2))
    trainer = zr.ZeroTrainer(_gpt2, _gpt2_loss, optimizer=zr.AdamW(lr=1e-2),
                             config=zr.ZeroConfig(stage=3, world_size=2))
    try:
        for _ in range(2):
            trainer.step(tokens)
        files = {size: trainer.export_pretrained(tmp_path / size, max_shard_size=size) for size in ("5GB", "30KB")}
        state = trainer.full_state_dict()
    finally:
        trainer.shutdown()
    reference = _gpt2().eval()
    reference.load_state_dict(state, strict=False)  # lm_head.weight is transformer.wte.weight
    reference.tie_weights()
    for size, written in files.items():
        out = tmp_path / size
        names = sorted(os.path.basename(f) for f in written)
        if size == "5GB":
            assert names == ["model.safetensors"]
        else:
            assert len(names) > 2 and "model.safetensors.index.json" in names
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"].values()) == set(names) - {"model.safetensors.index.json"}
        assert not [p for p in os.listdir(out) if p.startswith(".zero_ray-export")]  # the scratch save is gone
        _gpt2().config.save_pretrained(out)
        loaded = GPT2LMHeadModel.from_pretrained(out).eval()
        with torch.no_grad():
            assert torch.allclose(loaded(tokens).logits, reference(tokens).logits, atol=1e-6), size


def test_checkpoint_export_command_writes_the_same_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(5))
    trainer = zr.ZeroTrainer(_gpt2, _gpt2_loss, optimizer=zr.AdamW(lr=1e-2), config=zr.ZeroConfig(stage=1, world_size=2))
    try:
        trainer.step(tokens)
        saved = trainer.save_checkpoint(str(tmp_path / "ckpt"), wait=True)
        trainer.export_pretrained(tmp_path / "live")
    finally:
        trainer.shutdown()
    out = subprocess.run([sys.executable, "-m", "zero_ray.cli", "checkpoint", "export", saved, str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (tmp_path / "live" / "model.safetensors").read_bytes()


def _collective_breaks_once(marker: str, module: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """mse_loss, but once ``marker`` is armed the first rank to see it fails as a broken
    collective would (the error says nothing about the batch)."""
    try:
        os.unlink(marker)  # atomic: one rank, once; the step run again goes through
    except FileNotFoundError:
        return mse_loss(module, batch)
    raise zr.CollectiveError("the all-reduce broke (injected by the test)")


def test_fit_runs_a_reformed_step_again_when_its_collective_broke(tmp_path) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    dataset = _dataset()
    ref, _ = single_process(_linear, mse_loss, opt, reference_batches(
        dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED))
    marker = tmp_path / "break"
    loss_fn = functools.partial(_collective_breaks_once, str(marker))
    trainer = zr.ZeroTrainer(_linear, loss_fn, optimizer=opt, config=zr.ZeroConfig(stage=2, world_size=2))
    try:
        def arm_after_step_4(metrics: dict) -> None:
            if metrics["step"] == 4:
                marker.touch()

        result = trainer.fit(dataset, global_batch_size=FIT_BATCH, steps=FIT_STEPS, seed=FIT_SEED, progress=False,
                             callback=arm_after_step_4)
        got = trainer.full_state_dict()
        recovered = [(r.outcome.value, r.retry) for r in trainer.recoveries]
    finally:
        trainer.shutdown()
    assert not marker.exists()  # the failure did happen
    assert recovered == [("reformed", True)] and result["step"] == FIT_STEPS
    assert max_dev(got, ref) <= 1e-6
