"""An owner's process SIGKILLed between two calls is recovered by whichever call finds it, as a
loss found by a step is: full_state_dict, save_checkpoint, fit (its data setup), evaluate, the
memory and comm reports and export_pretrained each recover (peer copies), run again on the
recovered owners, and the run ends equal to single-process torch on fit's documented order."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from torch.nn.functional import mse_loss
from torch.utils.data import TensorDataset

import zero_ray as zr
from fit_order import reference_batches
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

BATCH, SEED = 12, 4


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(21)
    return TensorDataset(torch.randn(36, 8, generator=g), torch.randn(36, 4, generator=g))


def _linear() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    return mse_loss(module(batch[0]), batch[1])


def _sigkill(trainer: zr.ZeroTrainer, rank: int, *, timeout_s: float = 30.0) -> None:
    """SIGKILL rank ``rank``'s process and return once it is gone."""
    pid = ray.get(trainer.actors[rank].node.remote(), timeout=30)["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return  # dead, not yet reaped
        except FileNotFoundError:
            return
        time.sleep(0.05)  # polling a process's end, bounded in time
    raise AssertionError(f"pid {pid} still runs {timeout_s:g}s after SIGKILL")


def _reference(steps: int) -> dict[str, torch.Tensor]:
    batches = reference_batches(_dataset(), global_batch_size=BATCH, steps=steps, seed=SEED)
    return single_process(_linear, _loss, zr.SGD(lr=0.1, momentum=0.9), batches)[0]


def _max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_each_call_recovers_an_owner_lost_before_it(tmp_path: Path) -> None:
    dataset = _dataset()
    config = zr.ZeroConfig(stage=2, world_size=3, max_failures=12, health_interval_s=0.2, health_timeout_s=3.0,
                           bucket_bytes=4096, elastic=zr.ElasticConfig(redundancy="peer", max_world_size=3))
    trainer = zr.ZeroTrainer(_linear, _loss, optimizer=zr.SGD(lr=0.1, momentum=0.9), config=config)
    found: list[tuple[str, list[int], str]] = []

    def after_a_loss(name: str, call: Any) -> Any:
        before = len(trainer.recoveries)
        _sigkill(trainer, 1)
        out = call()
        new = trainer.recoveries[before:]
        found.extend((name, sorted(r.lost), r.outcome.value) for r in new)
        return out

    try:
        trainer.fit(dataset, global_batch_size=BATCH, steps=1, seed=SEED, progress=False)
        state = after_a_loss("full_state_dict", trainer.full_state_dict)
        assert _max_dev(state, _reference(1)) <= 1e-6
        saved = after_a_loss("save_checkpoint", lambda: trainer.save_checkpoint(tmp_path / "ckpt", wait=True))
        assert saved.endswith("step-00000001") and (tmp_path / "ckpt" / "latest").exists()
        after_a_loss("fit", lambda: trainer.fit(dataset, global_batch_size=BATCH, steps=2, seed=SEED,
                                                progress=False))
        batch = reference_batches(dataset, global_batch_size=BATCH, steps=1, seed=SEED)[0]
        loss = after_a_loss("evaluate", lambda: trainer.evaluate(batch))["loss"]
        memory = after_a_loss("memory_report", trainer.memory_report)
        assert len(memory) == trainer.world_size
        comm = after_a_loss("comm_report", trainer.comm_report)
        assert len(comm) == trainer.world_size
        files = after_a_loss("export_pretrained", lambda: trainer.export_pretrained(tmp_path / "export"))
        assert any(f.endswith("model.safetensors") for f in files)
        trainer.fit(dataset, global_batch_size=BATCH, steps=4, seed=SEED, progress=False)
        got = trainer.full_state_dict()
        manifest = json.loads((Path(saved) / "manifest.json").read_text())
    finally:
        trainer.shutdown()
    names = ["full_state_dict", "save_checkpoint", "fit", "evaluate", "memory_report", "comm_report",
             "export_pretrained"]
    # Each call found the loss itself and recovered it from the peers' copies, once.
    assert [(n, lost, outcome) for n, lost, outcome in found] == [(n, [1], "restored") for n in names]
    assert manifest["step"] == 1
    module = _linear()
    module.load_state_dict(_reference(2))
    with torch.no_grad():
        want = float(_loss(module, batch))
    assert loss == pytest.approx(want, abs=1e-6)
    assert _max_dev(got, _reference(4)) <= 1e-6
