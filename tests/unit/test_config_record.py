"""The whole ZeroConfig a checkpoint records (``zero_ray.config_record``) and what a resume
without a config does with it, without Ray: every field comes back; what a checkpoint cannot
record is named, never quietly replaced; a setting that cannot hold here is refused naming it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pyarrow.fs
import pytest
import torch
from checkpoint_builders import save

import zero_ray as zr
from zero_ray.checkpoint.format import MANIFEST_NAME, Manifest
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.config_record import config_record, restore_config
from zero_ray.driver.resume import resume_config
from zero_ray.errors import ConfigError
from zero_ray.models import mlp

# Every option away from its default, so that a field dropped on the way comes back different.
RUN = zr.ZeroConfig(
    stage=3, world_size=4, device="cpu", backend="gloo", dtype="bfloat16", reduce_dtype="float32", grad_accum_steps=2,
    max_grad_norm=1.0, seed=7, bucket_bytes=4096, optimizer_kinds={"my.Lion": "elementwise"},
    collective_timeout_s=30.0, step_timeout_s=40.0, init_timeout_s=50.0, num_cpus_per_owner=0.5,
    placement_strategy="SPREAD", loss_scale=zr.LossScaleConfig(growth_interval=10), on_nonfinite="skip",
    health_timeout_s=8.0, max_failures=5, control_token_dir="/var/tmp/tokens",
    stage3=zr.Stage3Config(wrap_policy=("GPT2Block",), prefetch_depth=2, persistence_threshold=100, max_live_units=4,
                           init="low_memory"),
    activation_checkpointing=zr.ActivationCheckpointing(offload=True), compile=zr.Compile(mode="default", dynamic=False),
    offload=zr.Offload(optimizer="nvme", params="nvme", path="/var/tmp/nvme"),
    checkpoint=zr.CheckpointConfig(dir="/var/tmp/ckpt", keep=2, timeout_s=60.0),
    elastic=zr.ElasticConfig(redundancy="peer", snapshot_every=2, min_world_size=2, max_world_size=8, grow_back=False,
                             detached=True, orphan_timeout_s=30.0),
)


def _through_json(config: zr.ZeroConfig, world_size: int | None = None) -> zr.ZeroConfig:
    restored = restore_config(json.loads(json.dumps(config_record(config, world_size=world_size))))
    assert restored.unrecorded == ()
    return restored.config


def test_every_field_comes_back_through_json() -> None:
    assert _through_json(RUN) == RUN
    assert _through_json(zr.ZeroConfig()) == zr.ZeroConfig()
    moved = _through_json(RUN, world_size=6)  # the run's size when saved, after a resize
    assert moved == dataclasses.replace(RUN, world_size=6)
    quantized = dataclasses.replace(RUN, elastic=zr.ElasticConfig(),
                                    topology=zr.Topology(shard_group_size=2, weight_comm="int8", quant_block=64))
    assert _through_json(quantized) == quantized


def test_weights_to_start_from_are_not_carried_the_checkpoint_replaces_them(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x")
    assert config_record(dataclasses.replace(RUN, init_state_dict=str(weights)))["init_state_dict"] is None
    assert _through_json(dataclasses.replace(RUN, init_state_dict={"w": torch.zeros(1)})).init_state_dict is None


def test_what_a_checkpoint_cannot_record_is_named_and_supplied() -> None:
    def mine(info: object) -> bool:
        return True

    odd = dataclasses.replace(RUN, stage3=zr.Stage3Config(wrap_policy=mine),
                              checkpoint=zr.CheckpointConfig(dir="bucket/ckpt", filesystem=pyarrow.fs.LocalFileSystem()))
    record = json.loads(json.dumps(config_record(odd)))
    restored = restore_config(record)
    names = [name for name, _ in restored.unrecorded]
    assert names == ["stage3.wrap_policy.fn", "checkpoint.filesystem"]
    assert "test_config_record.test_what_a_checkpoint_cannot_record_is_named_and_supplied.<locals>.mine" in \
        restored.describe()
    assert restored.config.stage3.wrap_policy == zr.WrapPolicy()  # the default stands in, and is named above
    fs = pyarrow.fs.LocalFileSystem()
    supplied = restore_config(record, supply={"checkpoint.filesystem": fs})
    assert supplied.config.checkpoint.filesystem is fs and [n for n, _ in supplied.unrecorded] == names[:1]


def test_a_record_this_zero_ray_cannot_read_is_refused_naming_it() -> None:
    record = config_record(RUN)
    record["offload"] = {"__class__": "os.system", "command": "true"}  # only zero_ray's option classes are built
    with pytest.raises(ConfigError, match="offload=.*not an option this zero_ray reads"):
        restore_config(record)
    newer = config_record(RUN)
    newer["elastic"]["quorum"] = 3
    with pytest.raises(ConfigError, match="recorded elastic cannot be rebuilt.*quorum"):
        restore_config(newer)


@pytest.fixture
def saved(tmp_path: Path) -> str:
    torch.manual_seed(0)
    return save(mlp(8, 2), tmp_path / "root", world_size=2).path


def _with_config(path: str, config: zr.ZeroConfig) -> Manifest:
    """The manifest at ``path`` rewritten as a run with ``config`` would have saved it."""
    where = os.path.join(path, MANIFEST_NAME)
    m = CheckpointReader(path).manifest
    m = dataclasses.replace(m, config=config_record(config), stage=config.stage)
    Path(where).write_text(m.to_json())
    return CheckpointReader(path).manifest


def test_a_resume_without_config_runs_the_saved_run(saved: str, tmp_path: Path) -> None:
    run = dataclasses.replace(RUN, stage=2, world_size=2, stage3=zr.Stage3Config(), elastic=zr.ElasticConfig(),
                              offload=zr.Offload(optimizer="nvme", path="/var/tmp/nvme"),
                              checkpoint=zr.CheckpointConfig(dir=str(tmp_path / "later")))
    m = _with_config(saved, run)
    assert m.format_version == 5 and resume_config(m, None, override=(), source="c") == run
    assert zr.ZeroTrainer.saved_config(saved) == run


def test_a_restored_setting_that_cannot_hold_here_is_refused_naming_it(saved: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = zr.ZeroConfig(world_size=2, checkpoint=zr.CheckpointConfig(dir=str(blocker / "ckpt")))
    m = _with_config(saved, run)
    with pytest.raises(ConfigError, match=f"checkpoint.dir='{blocker}/ckpt', which this driver cannot write"):
        resume_config(m, None, override=(), source="c")
    # A config passed is the caller's choice: the same directory is its own concern (the save will say).
    assert resume_config(m, run, override=(), source="c") == run


def test_a_callable_the_checkpoint_could_not_record_is_refused_then_supplied_again(
        saved: str, caplog: pytest.LogCaptureFixture) -> None:
    run = zr.ZeroConfig(world_size=2, stage=3, stage3=zr.Stage3Config(wrap_policy=lambda info: True))
    m = _with_config(saved, run)
    with pytest.raises(ConfigError, match=r"saved with stage3.wrap_policy.fn=<.*<lambda>>, which a checkpoint "
                                          r"cannot record; pass config="):
        resume_config(m, None, override=(), source="c")
    with caplog.at_level(logging.WARNING):
        fallback = zr.ZeroTrainer.saved_config(saved)
    assert fallback.stage3 == zr.Stage3Config() and "stage3.wrap_policy.fn" in caplog.text
    again = dataclasses.replace(fallback, stage3=run.stage3)
    assert resume_config(m, again, override=(), source="c") is again


def test_a_format_3_checkpoint_restores_the_math_and_says_the_rest_is_default(
        saved: str, caplog: pytest.LogCaptureFixture) -> None:
    where = os.path.join(saved, MANIFEST_NAME)
    data = json.loads(Path(where).read_text())
    data.update(format_version=3)
    del data["config"]
    m = Manifest.from_json(json.dumps(data), where=where)
    with caplog.at_level(logging.WARNING):
        back = resume_config(m, None, override=(), source="checkpoint c")
    assert back == zr.ZeroConfig(world_size=2, reduce_dtype="float32")  # the training record names it
    assert "checkpoint c (format 3) records only the settings that change the math" in caplog.text
