"""The user's own optimizers and scheduler on Ray actors, everywhere the state travels.

One recipe throughout, over a Hugging Face Llama built from a config: Muon for the hidden
matrices, Adafactor for the embeddings and head, AdamW for the norm weights, each under its own
OneCycleLR. Saved at stage 3 x 2 and resumed (at the same layout: bit for bit; at stage 1 x 3:
within the data-parallel noise of changing the world size), moved by live resizes, and
restored from peer copies after an owner's process is SIGKILLed, it ends where the
uninterrupted run does, with the same learning rates. The full matrix of optimizers x stages x
world sizes runs on thread ranks (tests/unit/test_optimizers_threads.py)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import ray
import torch

import zero_ray as zr
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS, SAVE_AT = 6, 3
UNITS = zr.Stage3Config(wrap_policy=("LlamaDecoderLayer",))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        use_cache=False))


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def hidden(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "embed" not in name and "lm_head" not in name


def muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for n, p in model.named_parameters() if hidden(n, p)], lr=0.02)


def adafactor(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor([p for n, p in model.named_parameters() if p.ndim == 2 and not hidden(n, p)],
                                 lr=1e-2)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.ndim == 1], lr=1e-2, weight_decay=0.0)


OPTIMIZERS = [muon, adafactor, adamw]


def one_cycle(opt: torch.optim.Optimizer) -> Any:
    # Adafactor has no momentum to cycle
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], total_steps=10,
                                               cycle_momentum=False)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 96, (12, 16), generator=g) for _ in range(STEPS)]


def config(stage: int, world_size: int, **kw: Any) -> zr.ZeroConfig:
    return zr.ZeroConfig(stage=stage, world_size=world_size, bucket_bytes=8192, health_timeout_s=5.0,
                         collective_timeout_s=60.0, stage3=UNITS if stage == 3 else zr.Stage3Config(), **kw)


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train(trainer: zr.ZeroTrainer, data: list[torch.Tensor], until: int) -> list[float]:
    return [trainer.step(data[trainer.step_count])["lr"] for _ in range(trainer.step_count, until)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Stage 3 x 2 for every step, saving a checkpoint after SAVE_AT of them."""
    root = tmp_path_factory.mktemp("optimizers")
    data = batches()
    with zr.ZeroTrainer(llama, loss_fn, optimizer=OPTIMIZERS, lr_scheduler=one_cycle, config=config(3, 2)) as t:
        lrs = train(t, data, SAVE_AT)
        t.save_checkpoint(str(root / "ckpt"), wait=True)
        lrs += train(t, data, STEPS)
        final = t.full_state_dict()
    # how far changing the world size from 2 to 3 moves this recipe, measured in one process
    two, _ = single_process(llama, loss_fn, OPTIMIZERS, data, lr_scheduler=one_cycle, pieces=(2, 1))
    three, _ = single_process(llama, loss_fn, OPTIMIZERS, data, lr_scheduler=one_cycle, pieces=(3, 1))
    return {"root": root, "data": data, "lrs": lrs, "final": final, "noise": max_dev(two, three)}


def test_resume_at_the_same_layout_is_bit_exact(uninterrupted: dict[str, Any]) -> None:
    data = uninterrupted["data"]
    with zr.ZeroTrainer.from_checkpoint(str(uninterrupted["root"] / "ckpt"), llama, loss_fn, optimizer=OPTIMIZERS,
                                        lr_scheduler=one_cycle, config=config(3, 2)) as t:
        assert t.step_count == SAVE_AT
        lrs = train(t, data, STEPS)
        assert max_dev(t.full_state_dict(), uninterrupted["final"]) == 0.0
    assert lrs == uninterrupted["lrs"][SAVE_AT:]


def test_resume_at_stage_1_on_three_owners(uninterrupted: dict[str, Any]) -> None:
    data = uninterrupted["data"]
    # without optimizer=: the checkpoint's classes and groups are rebuilt by parameter name
    with zr.ZeroTrainer.from_checkpoint(str(uninterrupted["root"] / "ckpt"), llama, loss_fn, lr_scheduler=one_cycle,
                                        config=config(1, 3)) as t:
        lrs = train(t, data, STEPS)
        dev = max_dev(t.full_state_dict(), uninterrupted["final"])
    print(f"resumed at stage 1 x 3: {dev:.3g} from the uninterrupted run (2 vs 3 ranks in one process: "
          f"{uninterrupted['noise']:.3g})")
    assert lrs == pytest.approx(uninterrupted["lrs"][SAVE_AT:], rel=1e-12)
    assert dev <= 2 * uninterrupted["noise"] + 1e-6


def test_resume_refuses_another_optimizer_or_a_missing_scheduler(uninterrupted: dict[str, Any]) -> None:
    path = str(uninterrupted["root"] / "ckpt")
    with pytest.raises(zr.CheckpointError, match=r"saved with optimizers \['Muon', 'Adafactor', 'AdamW'\] and "
                                                 r"this run builds \['SGD'\]"):
        zr.ZeroTrainer.from_checkpoint(path, llama, loss_fn, optimizer=lambda m: torch.optim.SGD(m.parameters()),
                                       config=config(1, 1))
    with pytest.raises(zr.ConfigError, match=r"stepped a learning-rate scheduler \(OneCycleLR\)"):
        zr.ZeroTrainer.from_checkpoint(path, llama, loss_fn, optimizer=OPTIMIZERS, config=config(1, 1))


def test_live_resizes_move_every_kind_of_state(uninterrupted: dict[str, Any]) -> None:
    # 2 -> 3 -> 2 with no step between: everything (masters, element-wise state, whole-tensor
    # state, step counts, schedulers) went through the transfers twice, and the run continues
    # bit for bit; then a resize with steps on either side stays within the noise.
    data = uninterrupted["data"]
    with zr.ZeroTrainer(llama, loss_fn, optimizer=OPTIMIZERS, lr_scheduler=one_cycle, config=config(3, 2)) as t:
        lrs = train(t, data, SAVE_AT)
        t.resize(3)
        t.resize(2)
        lrs += train(t, data, STEPS)
        assert max_dev(t.full_state_dict(), uninterrupted["final"]) == 0.0
        assert lrs == uninterrupted["lrs"]


def test_an_owner_sigkilled_is_restored_from_peer_copies(uninterrupted: dict[str, Any]) -> None:
    data = uninterrupted["data"]
    cfg = config(3, 2, elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(llama, loss_fn, optimizer=OPTIMIZERS, lr_scheduler=one_cycle, config=cfg) as t:
        lrs = train(t, data, SAVE_AT)
        pid = ray.get(t.actors[1].node.remote(), timeout=30)["pid"]
        os.kill(pid, signal.SIGKILL)  # the process, not ray.kill: as a crash or the OOM killer would
        lrs += train(t, data, STEPS)
        assert t.recoveries and t.recoveries[-1].source == "peer"
        assert t.world_size == 2
        assert max_dev(t.full_state_dict(), uninterrupted["final"]) == 0.0
    assert lrs == uninterrupted["lrs"]
