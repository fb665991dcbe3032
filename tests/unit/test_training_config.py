"""The run's position and training configuration without Ray: what a checkpoint records, what
a resume restores and refuses, format-2 manifests, the RNG states a checkpoint and a refused
step put back (CUDA through a fake), and the non-finite error's words."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from checkpoint_builders import save

import zero_ray as zr
from zero_ray.checkpoint.format import MANIFEST_NAME, Manifest
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.config import TRAINING_FIELDS, config_from_training, refuse_conflicts, training_conflicts, training_record
from zero_ray.core.run_position import Position
from zero_ray.driver.resume import recorded_training, resume_config
from zero_ray.errors import ConfigError
from zero_ray.models import mlp
from zero_ray.owner.step.rollback import StepGuard, rng_states, set_rng_states

RUN = zr.ZeroConfig(stage=2, world_size=2, dtype="bf16", grad_accum_steps=4, max_grad_norm=1.0, seed=7,
                    on_nonfinite="skip")


def test_the_record_is_json_and_normalised() -> None:
    record = training_record(RUN)
    assert list(record) == list(TRAINING_FIELDS)
    assert json.loads(json.dumps(record)) == record
    assert (record["dtype"], record["reduce_dtype"]) == ("bfloat16", "bfloat16")  # None reduces in the compute dtype
    same = dataclasses.replace(RUN, dtype="bfloat16", reduce_dtype="bf16", stage=3, world_size=5, bucket_bytes=4096,
                               device="cpu", step_timeout_s=5.0)
    assert training_conflicts(record, same) == []  # layout, placement and timeouts are not the math


def test_a_resume_without_config_restores_every_recorded_field() -> None:
    back = config_from_training(training_record(RUN), stage=1, world_size=3)
    assert (back.stage, back.world_size) == (1, 3)
    assert training_record(back) == training_record(RUN)
    kinds = dataclasses.replace(RUN, optimizer_kinds={"my.Lion": "elementwise"},
                                loss_scale=zr.LossScaleConfig(growth_interval=100), dtype="float16")
    assert training_record(config_from_training(training_record(kinds), stage=2, world_size=2)) == \
        training_record(kinds)


def test_a_config_that_changes_the_math_is_refused_naming_each_field() -> None:
    saved = training_record(RUN)
    other = dataclasses.replace(RUN, max_grad_norm=None, grad_accum_steps=1)
    with pytest.raises(ConfigError) as err:
        refuse_conflicts(saved, other, override=(), source="checkpoint /c/step-3", how="from_checkpoint")
    text = str(err.value)
    assert "checkpoint /c/step-3" in text
    assert "grad_accum_steps=4 in the checkpoint but 1 in config" in text
    assert "max_grad_norm=1.0 in the checkpoint but None in config" in text
    assert "from_checkpoint(..., override=('grad_accum_steps', 'max_grad_norm'))" in text
    # Named in override: accepted, and returned to be logged.
    assert refuse_conflicts(saved, other, override=("max_grad_norm", "grad_accum_steps"), source="c",
                            how="from_checkpoint") == [("grad_accum_steps", 4, 1), ("max_grad_norm", 1.0, None)]
    with pytest.raises(ConfigError, match="override=.*names \\['world_size'\\].*stage, world size and every other"):
        refuse_conflicts(saved, other, override=("world_size",), source="c", how="from_checkpoint")


def test_quantized_collectives_are_recorded_shard_groups_and_hpz_are_not() -> None:
    zero_pp = zr.ZeroConfig(stage=3, world_size=4, topology=zr.Topology(secondary_group_size=2, weight_comm="int8",
                                                                        grad_comm="int4"))
    saved = training_record(zero_pp)
    assert saved["topology"] == {"weight_comm": "int8", "grad_comm": "int4", "quant_block": 256}
    # Shard groups and hpZ move the same sums in full precision: a flat run of any size keeps the math.
    groups = zr.ZeroConfig(stage=3, world_size=4, topology=zr.Topology(shard_group_size=2, secondary_group_size=2))
    assert training_conflicts(training_record(groups), zr.ZeroConfig(stage=3, world_size=3)) == []
    assert training_record(groups)["topology"] == {"weight_comm": "fp32", "grad_comm": "fp32", "quant_block": None}
    with pytest.raises(ConfigError) as err:
        refuse_conflicts(saved, groups, override=(), source="checkpoint /c/step-3", how="from_checkpoint")
    assert "topology={'weight_comm': 'int8', 'grad_comm': 'int4', 'quant_block': 256} in the checkpoint but " \
           "{'weight_comm': 'fp32', 'grad_comm': 'fp32', 'quant_block': None} in config" in str(err.value)
    assert "override=('topology',)" in str(err.value)
    assert refuse_conflicts(saved, groups, override=("topology",), source="c", how="from_checkpoint")[0][0] == "topology"
    other_block = dataclasses.replace(zero_pp, topology=dataclasses.replace(zero_pp.topology, quant_block=128))
    assert [c[0] for c in training_conflicts(saved, other_block)] == ["topology"]
    # A resume without a config restores the collectives' dtypes (not the saving layout's groups).
    back = config_from_training(saved, stage=3, world_size=2)
    assert back.topology == zr.Topology(weight_comm="int8", grad_comm="int4")
    assert training_record(back) == saved


def test_loss_scaling_matters_only_in_float16() -> None:
    scaled = dataclasses.replace(RUN, loss_scale=zr.LossScaleConfig(init_scale=2.0**10))
    assert training_conflicts(training_record(RUN), scaled) == []
    fp16 = dataclasses.replace(RUN, dtype="float16")
    assert [c[0] for c in training_conflicts(training_record(fp16), dataclasses.replace(scaled, dtype="fp16"))] == \
        ["loss_scale"]


def test_on_nonfinite_is_checked() -> None:
    assert zr.ZeroConfig().on_nonfinite == "raise"
    with pytest.raises(ConfigError, match="on_nonfinite='ignore' is not one of \\('raise', 'skip'\\)"):
        zr.ZeroConfig(on_nonfinite="ignore")


def test_format_2_manifests_still_load_and_restore_what_they_kept(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = save(mlp(8, 2), tmp_path / "root", world_size=2)
    where = os.path.join(saved.path, MANIFEST_NAME)
    data = json.loads(open(where).read())
    assert data["format_version"] == 5 and data["training"]["grad_accum_steps"] == 1
    data.update(format_version=2, optimizer_steps=3, compute_dtype="bf16", seed=5)
    del data["training"], data["config"]
    m = Manifest.from_json(json.dumps(data), where=where)
    assert (m.step, m.samples_seen, dict(m.training)) == (3, 36, {})
    assert recorded_training(m) == {"dtype": "bfloat16", "seed": 5}
    back = resume_config(m, None, override=(), source="c")
    assert (back.stage, back.world_size, back.dtype, back.seed, back.max_grad_norm) == (2, 2, "bfloat16", 5, None)
    with pytest.raises(ConfigError, match="seed=5 in the checkpoint but 0 in config"):
        resume_config(m, zr.ZeroConfig(dtype="bf16"), override=(), source="c")
    with pytest.raises(ConfigError, match="nothing to override"):
        resume_config(m, None, override=("seed",), source="c")


def test_saved_config_is_what_a_resume_without_config_runs_with(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = save(mlp(8, 2), tmp_path / "root", world_size=3)
    config = zr.ZeroTrainer.saved_config(str(tmp_path / "root"))
    m = CheckpointReader(saved.path).manifest
    assert (config.stage, config.world_size) == (2, 3)
    assert training_record(config) == dict(m.training) == training_record(zr.ZeroConfig())


def test_a_position_only_moves_forward_by_a_step() -> None:
    at = Position(step=3, samples_seen=36)
    assert at.after(12) == Position(step=4, samples_seen=48)
    assert Position.from_data(at.to_data()) == at
    with pytest.raises(ConfigError, match="samples_seen=-1"):
        Position(step=0, samples_seen=-1)


class FakeCuda:
    """torch.cuda's RNG functions, recorded: the CUDA path without a GPU."""

    def __init__(self) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)
        self.set_calls: list[tuple[torch.Tensor, torch.device]] = []

    def is_initialized(self) -> bool:
        return True

    def get_rng_state(self, device: object = "cuda") -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, new_state: torch.Tensor, device: object = "cuda") -> None:
        self.set_calls.append((new_state, device))


def test_cuda_rng_states_are_saved_and_restored_per_device() -> None:
    cuda, gpu = FakeCuda(), torch.device("cuda", 1)
    states = rng_states(gpu, cuda=cuda)
    assert set(states) == {"torch", "cuda"} and torch.equal(states["cuda"], cuda.state)
    assert set(rng_states(torch.device("cpu"), cuda=cuda)) == {"torch"}  # a CPU owner has no CUDA generator
    expected = torch.rand(3)
    assert set_rng_states(states, gpu, cuda=cuda) == []
    assert torch.equal(torch.rand(3), expected)  # the CPU generator is back where it was
    assert len(cuda.set_calls) == 1 and cuda.set_calls[0][1] == gpu and torch.equal(cuda.set_calls[0][0], cuda.state)
    # A run saved on GPUs resumed on CPUs: the CUDA state has no generator there and is ignored.
    assert set_rng_states(states, torch.device("cpu"), cuda=cuda) == ["cuda"] and len(cuda.set_calls) == 1


def test_a_step_guard_puts_back_the_buffers_and_the_rng() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    module.train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    guard = StepGuard(module, torch.device("cpu"))
    kept = guard.keep()
    first = module(torch.full((3, 4), float("nan")))  # poisons the running statistics, draws dropout masks
    assert torch.isnan(module[1].running_mean).all()
    guard.restore(kept)
    after = module.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # parameters untouched, buffers put back
    again = module(torch.full((3, 4), float("nan")))
    assert torch.equal(torch.isnan(first), torch.isnan(again))  # nan where dropout kept; the same mask drawn


def test_the_non_finite_error_names_the_step_and_the_ranks() -> None:
    err = zr.NonFiniteError.refused(5, [1], [0, 1])
    assert isinstance(err, zr.ZeroRayError) and (err.step, err.loss_ranks, err.grad_ranks) == (5, (1,), (0, 1))
    text = str(err)
    assert text.startswith("step 5: non-finite values in the loss on rank 1 and the reduced gradient in the slices "
                           "of ranks 0, 1. The step was not taken")
    assert "step_count stays at 4" in text and 'on_nonfinite="skip"' in text


def test_heartbeats_default_to_four_per_health_timeout_and_an_interval_at_the_timeout_is_refused() -> None:
    assert zr.ZeroConfig().health_interval_s == 2.5
    assert zr.ZeroConfig(health_timeout_s=5.0).health_interval_s == 1.25
    assert zr.ZeroConfig(health_interval_s=0.2, health_timeout_s=3.0).health_interval_s == 0.2
    # a long timeout (slow steps) keeps the default within what an owner's Health stream accepts
    assert zr.ZeroConfig(health_timeout_s=600).health_interval_s == 60.0
    with pytest.raises(ConfigError, match=r"health_interval_s=120 is outside the \[0.01, 60.0\] seconds"):
        zr.ZeroConfig(health_interval_s=120, health_timeout_s=600)
    with pytest.raises(ConfigError, match=r"health_interval_s=0.001 is outside"):
        zr.ZeroConfig(health_interval_s=0.001)
    with pytest.raises(ConfigError, match="health_interval_s=3.0 must be below health_timeout_s=3.0"):
        zr.ZeroConfig(health_interval_s=3.0, health_timeout_s=3.0)
