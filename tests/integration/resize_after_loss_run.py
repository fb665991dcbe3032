"""Called by capacity_run.py (in test_capacity.py's own process, on a local Ray of exactly 4
CPUs): at the stage given, 3 owners with peer redundancy and max_world_size=4, one owner
SIGKILLed, three steps, then resize(4) while the loss's replacement is still starting."""

from __future__ import annotations

import functools
import os
import signal

import ray
import torch

import zero_ray as zr
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

MLP_FN = functools.partial(mlp, 16, 3)


def run(stage: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)) for _ in range(8)]
    opt = zr.SGD(lr=0.05, momentum=0.9)
    cfg = zr.ZeroConfig(stage=stage, world_size=3, bucket_bytes=4096, health_timeout_s=5.0,
                        elastic=zr.ElasticConfig(redundancy="peer", max_world_size=4),
                        stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)) if stage == 3
                        else zr.Stage3Config())
    seen: dict[str, object] = {"stage": stage}
    with zr.ZeroTrainer(MLP_FN, mse_loss, optimizer=opt, config=cfg) as trainer:
        trainer.step(batches[0])
        trainer.step(batches[1])
        pid = ray.get(trainer.actors[1].node.remote(), timeout=30)["pid"]
        os.kill(pid, signal.SIGKILL)
        for b in batches[2:5]:  # the first of these finds the loss; the run goes on at 2
            trainer.step(b)
        seen["lost"] = [sorted(r.lost) for r in trainer.recoveries]
        seen["before_resize"] = trainer.world_size
        seen["replacement_starting"] = any("replacements starting" in n for n in trainer.recoveries[0].notes)
        try:
            report = trainer.resize(4)
            seen["resize"] = [report["previous_world_size"], report["world_size"]]
        except zr.ZeroRayError as err:
            seen["resize_error"] = f"{type(err).__name__}: {err}"
            return seen
        for b in batches[5:]:
            trainer.step(b)
        seen["after"] = trainer.world_size
        got = trainer.full_state_dict()
    ref, _ = single_process(MLP_FN, mse_loss, opt, batches)
    seen["dev"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    return seen

