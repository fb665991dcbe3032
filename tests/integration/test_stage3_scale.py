"""Stage 3 trains a model no actor could hold: each actor's address space is capped (RLIMIT_AS)
below the size of one full fp32 copy of the model, so stage 2 fails while building it, and
stage 3 with four actors and the low-memory construction trains it: two steps on one batch, the
second's loss below the first's (a third step, 100M parameters gathered again, showed nothing more)."""

from __future__ import annotations

import functools

import pytest
import torch

import zero_ray as zr
from benchmarks.harness.probe import cap_address_space
from zero_ray.config import Stage3Config
from zero_ray.models import mlp, mse_loss

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

WIDTH, DEPTH = 1024, 96  # 96 x Linear(1024): 100.8M parameters, 403 MB in fp32
PSI = DEPTH * (WIDTH * WIDTH + WIDTH)
# Per actor, on top of what it maps when model_fn starts. Stage 3 needs its fp32 shards (2 x 4
# bytes x PSI / 4 = 202 MB), 25 MB of buffers and about 80 MB of one-time torch warm-up.
CAP_BYTES = 340 * 2**20


def capped_model(cap_bytes: int) -> torch.nn.Module:
    """Cap this actor's address space at what it maps now plus ``cap_bytes``, then build."""
    cap_address_space(cap_bytes)
    return mlp(WIDTH, DEPTH)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)


def test_stage_2_cannot_build_the_model_under_the_cap_and_stage_3_trains_it() -> None:
    assert 4 * PSI > CAP_BYTES  # one full fp32 copy does not fit in an actor
    model_fn = functools.partial(capped_model, CAP_BYTES)
    opt = zr.SGD(lr=1e-3)  # fp32 SGD: the master weights are the parameter shard (K = 0)
    # Under an address-space cap the allocation that fails first varies from run to run: a
    # MemoryError, the allocator's RuntimeError, or CPython's own SystemError (all seen here).
    # One owner shows it: at stage 2 each owner builds the whole model, whatever the world size
    # (four had started three more processes, each failing the same way).
    with pytest.raises(zr.ZeroRayError, match="(?i)setup"):
        zr.ZeroTrainer(model_fn, mse_loss, optimizer=opt,
                       config=zr.ZeroConfig(stage=2, world_size=1, init_timeout_s=300))
    config = zr.ZeroConfig(stage=3, world_size=4, init_timeout_s=600, step_timeout_s=600,
                           stage3=Stage3Config(init="low_memory"))
    with zr.ZeroTrainer(model_fn, mse_loss, optimizer=opt, config=config) as trainer:
        assert trainer.num_params == PSI
        losses = [trainer.step(_batch(0))["loss"] for _ in range(2)]
        memory = trainer.memory_report()
    print(f"stage 3 under a {CAP_BYTES / 2**20:.0f} MiB cap per actor: losses {losses}, "
          f"rank 0 holds {memory[0]['total'] / 2**20:.1f} MiB "
          f"(model state {(memory[0]['params'] + memory[0]['grads']) / 2**20:.1f} MiB, "
          f"buffers {(memory[0]['gather_buffers'] + memory[0]['reduce_buffers']) / 2**20:.1f} MiB)")
    assert losses[-1] < losses[0]  # the same batch twice: SGD lowers its loss
    for rank in memory:
        assert rank["params"] + rank["padding_params"] == rank["padded_numel"] // 4 * 4  # fp32 shard, 1/4 each
        assert rank["total"] < CAP_BYTES
