"""Sharded checkpoints on an object store with real owners: the session's local S3 server (moto),
reached by the driver and every owner only through the standard AWS_* environment.

Save at stage 2 x 2 to s3:// (keep=2 over three saves), resume at stage 3 x 3 from the URL and at
stage 1 x 1 through a filesystem object, each equal to the uninterrupted run; export to s3://;
an owner SIGKILLed in the middle of its upload leaves ``latest`` on the previous checkpoint,
which still loads. Lean on purpose: four trainer starts in all.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
import ray
import torch
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

import zero_ray as zr
from zero_ray.checkpoint import store
from zero_ray.checkpoint.location import open_location
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import consolidate, inspect_checkpoint
from zero_ray.models import mlp, mse_loss

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS, BATCH = 5, 12
MLP_FN = functools.partial(mlp, 16, 3)
UNITS = zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0))


def batches(width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)) for _ in range(STEPS)]


def config(stage: int, world_size: int, **kw) -> zr.ZeroConfig:  # type: ignore[no-untyped-def]
    return zr.ZeroConfig(stage=stage, world_size=world_size, bucket_bytes=4096,
                         stage3=UNITS if stage == 3 else zr.Stage3Config(), **kw)


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_save_at_stage2x2_on_s3_resumes_at_3x3_and_1x1(s3: S3Server) -> None:
    bucket = s3.create_bucket("roundtrip")
    root = f"s3://{bucket}/run"
    opt, data = zr.SGD(lr=0.05, momentum=0.9, weight_decay=0.01), batches()
    trainer = zr.ZeroTrainer(MLP_FN, mse_loss, optimizer=opt,
                             config=config(2, 2, checkpoint=zr.CheckpointConfig(dir=root, keep=2)))
    try:
        saved = []
        for k, b in enumerate(data):
            trainer.step(b)
            if k + 1 <= 3:  # uploaded in the background while the next steps run
                saved.append(trainer.save_checkpoint())
        assert trainer.wait_for_checkpoint() == saved[-1] == f"{root}/step-00000003"
        uninterrupted = trainer.full_state_dict()
        exported = trainer.export_pretrained(f"s3://{bucket}/export")
    finally:
        trainer.shutdown()

    storage, path = open_location(root)
    assert store.committed(path, storage=storage) == ["step-00000002", "step-00000003"]  # keep=2, in the bucket
    assert not [k for k in s3.keys(bucket, "run/") if "step-00000001" in k]
    assert exported == [f"s3://{bucket}/export/model.safetensors"]
    assert not [k for k in s3.keys(bucket, "export/") if ".zero_ray-export" in k]  # the scratch save is gone
    weights = load_safetensors(s3.get(bucket, "export/model.safetensors"))
    assert all(torch.equal(weights[n], uninterrupted[n]) for n in uninterrupted)

    import pyarrow.fs as pafs  # a user's own filesystem object, credentials and all, as Ray Train takes one

    fs = pafs.S3FileSystem(endpoint_override=s3.endpoint, region=REGION, access_key=ACCESS_KEY,
                           secret_key=SECRET_KEY)
    for stage, n, where, filesystem in [(3, 3, saved[1], None), (1, 1, f"{bucket}/run/step-00000002", fs)]:
        resumed = zr.ZeroTrainer.from_checkpoint(where, MLP_FN, mse_loss, config=config(stage, n),
                                                 filesystem=filesystem)
        try:
            assert resumed.step_count == 2
            for b in data[2:]:
                resumed.step(b)
            dev = max_dev(resumed.full_state_dict(), uninterrupted)
        finally:
            resumed.shutdown()
        print(f"stage 2 x 2 on s3 -> stage {stage} x {n}: {dev:.2e}")
        assert dev <= 1e-6


def test_an_owner_killed_mid_upload_leaves_latest_loadable(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.create_bucket("killed")
    root = f"s3://{bucket}/run"
    data = batches(1024)
    # 3.1M parameters: each rank's file (master + momentum of half of them) is over pyarrow's
    # 10 MiB part size, so it goes up as a multipart upload that can be caught between parts.
    trainer = zr.ZeroTrainer(functools.partial(mlp, 1024, 3), mse_loss, optimizer=zr.SGD(lr=0.05, momentum=0.9),
                             config=config(2, 2))
    try:
        trainer.step(data[0])
        first = trainer.save_checkpoint(root, wait=True)
        at_first = trainer.full_state_dict()
        trainer.step(data[1])
        pid = ray.get(trainer.actors[1].node.remote(), timeout=60)["pid"]
        with s3.holding(r"/run/step-00000002/rank-00001-of-00002\.safetensors\?partNumber=", methods=("PUT",)) as hold:
            trainer.save_checkpoint(root)  # returns after the snapshot: the upload runs in the background
            assert hold.arrived.wait(timeout=120), "rank 1's upload never reached the store"
            os.kill(pid, signal.SIGKILL)  # a real process killed by a signal, mid-upload
        with pytest.raises(zr.CheckpointError, match="abandoned"):
            trainer.wait_for_checkpoint(timeout_s=300)
    finally:
        trainer.shutdown()

    assert s3.get(bucket, "run/latest") == b"step-00000001"
    keys = s3.keys(bucket, "run/step-00000002")
    assert "run/step-00000002/manifest.json" not in keys
    assert "run/step-00000002/rank-00001-of-00002.safetensors" not in keys  # an interrupted upload is no object
    assert CheckpointReader(root).path == first
    assert inspect_checkpoint(root, verify=True)["step"] == 1
    out = tmp_path / "full.safetensors"
    consolidate(root, str(out))
    state = load_file(str(out))
    assert all(torch.equal(state[n], at_first[n]) for n in at_first)
