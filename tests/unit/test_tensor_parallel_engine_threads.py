"""ZeRO across tensor-parallel groups on thread ranks (issue 45, second layer): OwnerEngines on
T x D ranks, each TP group sharding a Hugging Face Llama with grouped-query attention by its own
plan and each TP shard's model state partitioned over its D data-parallel ranks, against
single-process torch in fp32: per-step losses and final parameters (gathered to whole shapes)
within 1e-5 at stages 0-3, SGD and AdamW, layouts (T, D) = (2, 1), (2, 2), (4, 1), with global
clipping engaged (one norm over TP and DP, a replicated parameter counted once). Per-rank model
state at stage 3 is the paper's formula with N_m = T, N_d = D. The ranks are threads over the
in-memory Collective (tests/thread_ranks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_ray as zr
from thread_ranks import run_tp_ranks
from tp_llama import CLIP, OPTIMIZERS, VOCAB, batches, first_norm, llama, lm_loss, reference
from zero_ray.core.memory_formulas import model_state_bytes, optimizer_bytes_per_param
from zero_ray.errors import ConfigError
from zero_ray.testing import single_process

TOLERANCE = 1e-5
STEPS = 4
LAYOUTS = [(2, 1), (2, 2), (4, 1)]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("size", "data_parallel"), LAYOUTS)
def test_llama_gqa_matches_single_process(size: int, data_parallel: int, stage: int, optimizer: str) -> None:
    ref, ref_losses = reference(optimizer, data_parallel, STEPS)
    got, losses, engines, results = run_tp_ranks(size, data_parallel, llama, lm_loss, OPTIMIZERS[optimizer],
                                                 batches(STEPS), stage=stage, clip=CLIP)
    assert got.keys() == ref.keys()
    for name, value in got.items():
        assert value.shape == ref[name].shape, name
        assert float((value - ref[name]).abs().max()) <= TOLERANCE, name
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE
    # every rank clipped by one global norm, the single process's: a replicated parameter (a norm
    # weight, the embeddings) counted once, not once per TP rank
    assert first_norm() > CLIP
    assert all(abs(r[0].grad_norm - first_norm()) <= 1e-5 * first_norm() for r in results)
    assert [e.data_rank for e in engines] == [r // size for r in range(size * data_parallel)]


def token_sum_loss(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return total, targets.numel()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_token_count_loss_with_accumulation_counts_each_data_rank_once(stage: int) -> None:
    # every TP rank of a data-parallel rank reads the same tokens: counted once, not T times
    # (no clipping here: it would hide a gradient scaled by a wrong count)
    ref, _ = single_process(llama, lm_loss, OPTIMIZERS["sgd"], batches(2), pieces=(2, 2))
    got, _, _, _ = run_tp_ranks(2, 2, llama, token_sum_loss, OPTIMIZERS["sgd"], batches(2), stage=stage, accum=2)
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= TOLERANCE


class Mlp(nn.Module):
    """Every parameter sharded: each TP rank holds exactly 1/T of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def test_stage3_model_state_per_rank_is_the_formula_with_n_m_and_n_d() -> None:
    size, data_parallel = 2, 2
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    _, _, engines, _ = run_tp_ranks(size, data_parallel, Mlp, mse, zr.AdamW(lr=1e-3), [x], stage=3,
                                 plan={"up": "colwise", "down": "rowwise"})
    psi = sum(p.numel() for p in Mlp().parameters())
    k = optimizer_bytes_per_param("adamw", mixed_precision=False)
    want = model_state_bytes(stage=3, num_params=psi, world_size=data_parallel, model_parallel=size, param_bytes=4,
                             grad_bytes=4, optimizer_bytes=k)
    for e in engines:
        m = e.memory_report()
        assert m["numel"] * size == psi and m["padding_params"] == 0  # 1/T of the model, split evenly over D
        assert (m["params"], m["grads"], m["optimizer"]) == (want.params, want.grads, want.optimizer)
        held = m["total"] - m["optimizer_scalars"] - m["gather_buffers"] - m["reduce_buffers"]
        assert held == want.total == (4 + 4 + k) * psi // (size * data_parallel)
        assert m["total"] == m["held_storage_bytes"]


def test_llama_stage3_model_state_is_the_formula_over_each_rank_s_slice() -> None:
    # Llama's plan keeps embeddings, norms and the head whole on every TP rank: a rank's slice is
    # the sharded parameters over T plus the replicated ones, partitioned over D like any model.
    size, data_parallel = 2, 2
    _, _, engines, _ = run_tp_ranks(size, data_parallel, llama, lm_loss, zr.AdamW(lr=1e-3), batches(1), stage=3)
    torch.manual_seed(0)
    whole = llama()
    sharded = sum(p.numel() for n, p in whole.named_parameters() if n.endswith("proj.weight"))
    replicated = sum(p.numel() for p in whole.parameters()) - sharded
    k = optimizer_bytes_per_param("adamw", mixed_precision=False)
    for e in engines:
        m = e.memory_report()
        assert m["numel"] == sharded // size + replicated
        want = model_state_bytes(stage=3, num_params=m["padded_numel"], world_size=data_parallel, param_bytes=4,
                                 grad_bytes=4, optimizer_bytes=k)
        assert m["params"] + m["padding_params"] == want.params
        assert m["optimizer"] + m["padding_optimizer"] == want.optimizer


def test_a_topology_with_tensor_parallel_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"tensor parallelism \(size=2\) with .* is not built yet"):
        run_tp_ranks(2, 2, llama, lm_loss, zr.SGD(lr=0.1), batches(1), stage=2,
                     topology=zr.Topology(shard_group_size=2))


@pytest.mark.parametrize(("size", "data_parallel"), [(2, 2), (4, 1)])
def test_zero_traffic_stays_in_the_data_parallel_group_and_tp_bytes_are_apart(size: int, data_parallel: int) -> None:
    _, _, engines, _ = run_tp_ranks(size, data_parallel, llama, lm_loss, zr.SGD(lr=0.1), batches(2), stage=2)
    for e in engines:
        sent = e.last_bytes
        zero = sum(n for op, n in sent.items() if not op.startswith("tp_") and op != "scalars")
        # stage 2: a reduce-scatter of the gradients and an all-gather of the parameters, over
        # the D ranks holding this TP shard (the paper's 2 (N_d - 1) / N_d of the rank's slice)
        padded = e.memory_report()["padded_numel"]
        assert zero == 2 * (data_parallel - 1) * padded // data_parallel * 4
        assert sent["tp_all_reduce"] > 0  # the layers' sums, counted apart
        # rings: each rank sends to the next of its TP group and the next of its DP group only
        nexts = set()
        for members in (e.fabric.ranks.tp_members(e.rank), e.fabric.ranks.dp_members(e.rank)):
            nexts.add(members[(members.index(e.rank) + 1) % len(members)])
        assert set(e.last_peers) == nexts - {e.rank}


def test_a_whole_tensor_optimizer_over_a_tp_shard_is_refused_by_name() -> None:
    muon = lambda m: torch.optim.Muon([m.up.weight, m.down.weight], lr=0.01)  # noqa: E731
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    with pytest.raises(ConfigError, match=r"Muon steps whole tensors.*splits 2 of its parameters.*'up\.weight'"):
        run_tp_ranks(2, 1, Mlp, mse, muon, [x], stage=1, plan={"up": "colwise", "down": "rowwise"})
    # the same optimizer on a module the plan leaves whole trains
    got, _, _, _ = run_tp_ranks(2, 1, Mlp, mse, muon, [x], stage=1, plan={"up": "replicated", "down": "replicated"})
    ref, _ = single_process(Mlp, mse, muon, [x])
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= TOLERANCE
