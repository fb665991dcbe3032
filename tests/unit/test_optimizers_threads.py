"""The user's own torch.optim optimizers and schedulers on thread ranks, against single-process
torch with the same factories: every element-wise optimizer at stages 0-3 x world sizes 1-3,
per-group hyperparameters under a per-group scheduler, Muon + AdamW and Adafactor over a
Hugging Face Llama built from a config, and the bytes each rank holds and sends.

Thread ranks (tests/thread_ranks.py) run the owners' engine without Ray, so the whole matrix
takes about a minute; tests/integration/test_optimizers.py checks the same on Ray actors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import zero_ray as zr
from thread_ranks import run_ranks
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

STEPS = 4
GLOBAL_BATCH = 13  # uneven over 2 and 3 ranks
MLP_FN = functools.partial(mlp, 16, 3)


def mlp_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 16, generator=g))
            for _ in range(steps)]


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def factory(cls: type, **kwargs: Any) -> Any:
    """``lambda model: cls(model.parameters(), **kwargs)``, picklable and readable in test ids."""
    return functools.partial(_build, cls, kwargs)


def _build(cls: type, kwargs: dict[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    return cls(model.parameters(), **kwargs)


ELEMENTWISE = {
    "sgd": factory(torch.optim.SGD, lr=0.05),
    "sgd-nesterov": factory(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening-fused": factory(torch.optim.SGD, lr=0.05, momentum=0.5, dampening=0.2, fused=True),
    "adam": factory(torch.optim.Adam, lr=1e-2, weight_decay=0.01),
    "adam-amsgrad-foreach": factory(torch.optim.Adam, lr=1e-2, amsgrad=True, foreach=True),
    "adamw-fused": factory(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-amsgrad": factory(torch.optim.AdamW, lr=1e-2, amsgrad=True),
    "adagrad": factory(torch.optim.Adagrad, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop-centered": factory(torch.optim.RMSprop, lr=1e-2, centered=True, momentum=0.5),
    "rmsprop": factory(torch.optim.RMSprop, lr=1e-2),
    "adamax": factory(torch.optim.Adamax, lr=1e-2),
    "nadam-decoupled": factory(torch.optim.NAdam, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "radam": factory(torch.optim.RAdam, lr=1e-2),
    "asgd": factory(torch.optim.ASGD, lr=1e-2, t0=2),
    "rprop": factory(torch.optim.Rprop, lr=1e-2),
}
CASES = [(name, stage, n) for name in ELEMENTWISE for stage in (0, 1, 2, 3) for n in (1, 2, 3)]


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {name: single_process(MLP_FN, mse_loss, f, mlp_batches())[0] for name, f in ELEMENTWISE.items()}


@pytest.mark.parametrize(("name", "stage", "world_size"), CASES)
def test_every_elementwise_optimizer_matches_one_process(references: dict[str, dict[str, torch.Tensor]], name: str,
                                                         stage: int, world_size: int) -> None:
    got, engines, _ = run_ranks(world_size, MLP_FN, mse_loss, ELEMENTWISE[name], mlp_batches(), stage=stage,
                                accum=2)
    assert max_dev(got, references[name]) <= 2e-5
    # the state is the user's class's own, one entry per fragment this rank updates
    opt = engines[-1].state.optimizer.optimizers[0]
    assert type(opt).__name__ == ELEMENTWISE[name].args[0].__name__


def two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "lr": 3e-2,
                               "weight_decay": 0.1},
                              {"params": [p for n, p in named if n.endswith("bias")], "lr": 1e-2,
                               "weight_decay": 0.0, "betas": (0.8, 0.95)}])


def one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[3e-2, 1e-2], total_steps=10)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_param_groups_under_a_per_group_scheduler(stage: int) -> None:
    batches = mlp_batches(6)
    ref, _ = single_process(MLP_FN, mse_loss, two_groups, batches, lr_scheduler=one_cycle, max_grad_norm=0.5)
    got, engines, _ = run_ranks(3, MLP_FN, mse_loss, two_groups, batches, stage=stage, lr_scheduler=one_cycle,
                                clip=0.5)
    assert max_dev(got, ref) <= 2e-5
    torch.manual_seed(0)
    reference_opt = two_groups(MLP_FN())
    sched = one_cycle(reference_opt)
    for _ in batches:
        reference_opt.step()
        sched.step()
    for engine in engines:  # every rank's scheduler moved its groups' lr as torch's did
        lrs = [g["lr"] for g in engine.state.optimizer.optimizers[0].param_groups]
        assert lrs == pytest.approx([g["lr"] for g in reference_opt.param_groups], rel=1e-12)


# -- whole-tensor optimizers over a model nobody here wrote ------------------------------------------
def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        use_cache=False))


def llama_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def token_batches(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (12, 16), generator=g) for _ in range(steps)]


def hidden(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "embed" not in name and "lm_head" not in name


def muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for n, p in model.named_parameters() if hidden(n, p)], lr=0.02)


def adamw_rest(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for n, p in model.named_parameters() if not hidden(n, p)], lr=1e-3)


class HalvesMuon(torch.optim.Optimizer):
    """Muon applied to each half of every matrix apart: what a flat partition of the matrices
    would compute (for scale: how far that lands from the real thing)."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        super().__init__(params, {})
        self._halves = {id(p): (p.data[: p.shape[0] // 2], p.data[p.shape[0] // 2:]) for p in params}
        self._inner = torch.optim.Muon([h for pair in self._halves.values() for h in pair], lr=0.02)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                top, bottom = self._halves[id(p)]
                top.grad, bottom.grad = p.grad[: top.shape[0]], p.grad[top.shape[0]:]
        self._inner.step()


def muon_halves(model: torch.nn.Module) -> torch.optim.Optimizer:
    return HalvesMuon([p for n, p in model.named_parameters() if hidden(n, p)])


@pytest.fixture(scope="module")
def muon_reference() -> dict[str, Any]:
    batches = token_batches()
    ref, _ = single_process(llama, llama_loss, [muon, adamw_rest], batches)
    noise = {n: max_dev(single_process(llama, llama_loss, [muon, adamw_rest], batches, pieces=(n, 1))[0], ref)
             for n in (2, 3)}
    halves = max_dev(single_process(llama, llama_loss, [muon_halves, adamw_rest], batches)[0], ref)
    print(f"Muon data-parallel noise (one process, batch in parts): {noise}; Muon over matrix halves: {halves:.3g}")
    return {"ref": ref, "noise": noise, "halves": halves, "batches": batches}


@pytest.mark.parametrize(("stage", "world_size"), [(s, n) for s in (0, 1, 2, 3) for n in (1, 2, 3)])
def test_muon_with_adamw_is_within_data_parallel_noise(muon_reference: dict[str, Any], stage: int,
                                                        world_size: int) -> None:
    got, engines, sent = run_ranks(world_size, llama, llama_loss, [muon, adamw_rest], muon_reference["batches"],
                                   stage=stage, wrap_policy=("LlamaDecoderLayer",))
    dev = max_dev(got, muon_reference["ref"])
    print(f"stage {stage} x {world_size}: Muon + AdamW {dev:.3g} from one process")
    if world_size == 1:
        assert dev == 0.0
        return
    # bf16 Newton-Schulz magnifies the summation order of split batches; zero_ray is within a small
    # multiple of that noise, and far from what Muon on pieces of matrices computes
    assert dev <= 2 * muon_reference["noise"][world_size]
    assert dev < muon_reference["halves"] / 3
    whole = [e.state.optimizer for e in engines]
    stepped = [sorted(o.whole_params_here()) for o in whole]
    if stage == 0:
        assert all(s == stepped[0] for s in stepped)  # replicated, as DDP
        assert "whole_tensor_gather" not in sent[0][-1]
    else:
        flat = [p for s in stepped for p in s]
        assert len(flat) == len(set(flat)) == len(whole[0].whole_plan.assignee)  # each on exactly one owner


def adafactor(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


@pytest.mark.parametrize(("stage", "world_size"), [(s, n) for s in (0, 1, 2, 3) for n in (1, 2, 3)])
def test_adafactor_matches_one_process(stage: int, world_size: int) -> None:
    batches = token_batches()
    ref, _ = single_process(llama, llama_loss, adafactor, batches)
    got, _, _ = run_ranks(world_size, llama, llama_loss, adafactor, batches, stage=stage,
                          wrap_policy=("LlamaDecoderLayer",))
    assert max_dev(got, ref) <= 2e-5


# -- memory and traffic --------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elementwise_state_is_the_shard_times_the_state_per_element(stage: int) -> None:
    # Adam keeps two fp32 states per element: over the shard, padding included, as the paper counts
    _, engines, _ = run_ranks(3, MLP_FN, mse_loss, factory(torch.optim.Adam, lr=1e-2), mlp_batches(2), stage=stage)
    for engine in engines:
        report = engine.memory_report()
        shard = engine.layout.shard_numel
        # fp32 compute: the parameters are their own master copy, so K = 8 bytes of state
        assert report["optimizer"] + report["padding_optimizer"] == 2 * 4 * shard
        held = sum(t.numel() for g in engine.state.trainable_groups for t in g.moments.values())
        assert held == 2 * shard
        fragments = sum(1 for _ in engine.state.optimizer.pieces)
        assert report["optimizer_scalars"] == 4 * fragments  # one fp32 step per fragment
        assert report["total"] == report["held_storage_bytes"]


def test_whole_tensor_state_is_at_most_a_share_plus_the_largest() -> None:
    _, engines, sent = run_ranks(3, llama, llama_loss, adafactor, token_batches(2), stage=3,
                                 wrap_policy=("LlamaDecoderLayer",))
    per_rank = [sum(e.layout.params[p].numel for p in e.state.optimizer.whole_params_here()) for e in engines]
    total = sum(p.numel for p in engines[0].layout.params)
    largest = max(p.numel for p in engines[0].layout.params)
    assert sum(per_rank) == total
    assert max(per_rank) <= total / 3 + largest
    # the extra traffic is counted under its own names: gradients and values in, values out
    for rank, engine in enumerate(engines):
        plan = engine.state.optimizer.whole_plan
        held_elsewhere = sum(piece.numel for p, pieces in plan.pieces.items() if plan.assignee[p] != rank
                             for piece in pieces if piece.rank == rank)
        assert sent[rank][-1].get("whole_tensor_gather", 0) == 2 * 4 * held_elsewhere


def test_unknown_and_unsuitable_optimizers_are_refused() -> None:
    class Lion(torch.optim.SGD):  # a class zero_ray does not know, however it is built
        pass

    lion = factory(Lion, lr=0.1)
    with pytest.raises(zr.ConfigError, match=r"optimizer_kinds=\{Lion: 'elementwise'\}"):
        run_ranks(2, MLP_FN, mse_loss, lion, mlp_batches(1), stage=1)
    ref, _ = single_process(MLP_FN, mse_loss, lion, mlp_batches(2))
    got, _, _ = run_ranks(2, MLP_FN, mse_loss, lion, mlp_batches(2), stage=1, optimizer_kinds={Lion: "elementwise"})
    assert max_dev(got, ref) <= 1e-6
    with pytest.raises(zr.ConfigError, match="LBFGS cannot train under ZeRO"):
        run_ranks(2, MLP_FN, mse_loss, factory(torch.optim.LBFGS), mlp_batches(1), stage=1)
    with pytest.raises(zr.ConfigError, match="SparseAdam cannot train under ZeRO"):
        run_ranks(2, MLP_FN, mse_loss, factory(torch.optim.SparseAdam), mlp_batches(1), stage=1)
    with pytest.raises(zr.ConfigError, match="optimizer 0 and optimizer 1"):
        run_ranks(1, MLP_FN, mse_loss, [factory(torch.optim.SGD, lr=0.1), factory(torch.optim.Adam)],
                  mlp_batches(1), stage=1)


# -- the mixed-precision policy ------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bfloat16_gradients_reduced_in_float32(stage: int) -> None:
    opt = zr.AdamW(lr=1e-3)
    batches = mlp_batches()
    ref, _ = single_process(MLP_FN, mse_loss, opt, batches)
    _, plain, plain_sent = run_ranks(2, MLP_FN, mse_loss, opt, batches, stage=stage, dtype="bfloat16", accum=2)
    got, engines, sent = run_ranks(2, MLP_FN, mse_loss, opt, batches, stage=stage, dtype="bfloat16", accum=2,
                                   reduce_dtype="float32")
    assert max_dev(got, ref) <= 5e-3  # docs/numerics.md's bf16 tolerance
    for engine in engines:
        report, before = engine.memory_report(), plain[engine.rank].memory_report()
        assert report["grads"] + report["padding_grads"] == 2 * (before["grads"] + before["padding_grads"])
        assert report["params"] == before["params"]  # compute stays bf16
    reduced = "all_reduce" if stage == 0 else "reduce_scatter"
    assert sent[0][-1][reduced] == 2 * plain_sent[0][-1][reduced]
