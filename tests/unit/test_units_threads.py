"""Stage 3 (and the stage 0-2 gradient lifetime) end to end without Ray: N ranks as threads of
one process over an in-memory group.

Fast (about a second each) checks of the gather/reduce machinery at world sizes 1-4: parity
with the single process, bytes sent per step, the bounded buffer pool and the persistent
parameters. The same properties are checked on real Ray actors over gloo in
tests/integration/test_stage3*.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

import zero_ray as zr
from thread_ranks import run_ranks
from zero_ray.models import GPT, GPTConfig, lm_loss, mlp, mse_loss
from zero_ray.testing import single_process


def _mlp_batches(steps: int = 3, n: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)) for _ in range(steps)]


GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
GPT_FN = functools.partial(GPT, GPT_CFG)
MLP_FN = functools.partial(mlp, 16, 3)


def _gpt_batches(steps: int = 3, n: int = 13) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, GPT_CFG.vocab_size, (n, 17), generator=g) for _ in range(steps)]


def _max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_sgd_matches_single_process_on_thread_ranks(model: str, world_size: int) -> None:
    opt = zr.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)
    fn, loss, batches, clip = ((MLP_FN, mse_loss, _mlp_batches(), 0.15) if model == "mlp"
                               else (GPT_FN, lm_loss, _gpt_batches(), 1.0))
    ref, _ = single_process(fn, loss, opt, batches, max_grad_norm=clip)
    got, engines, _ = run_ranks(world_size, fn, loss, opt, batches, accum=2, clip=clip, max_live_units=1)
    assert _max_dev(got, ref) <= 1e-6
    assert all(e.state.peak_gathered_bytes > 0 for e in engines)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_sent_are_three_gathers_worth_of_the_flat_buffers(world_size: int) -> None:
    _, engines, sent = run_ranks(world_size, GPT_FN, lm_loss, zr.AdamW(lr=1e-3), _gpt_batches(2))
    padded = engines[0].layout.padded_numel
    for rank_sent in sent:
        last = rank_sent[-1]
        third = (world_size - 1) * padded // world_size * 4
        assert last["all_gather_forward"] == last["all_gather_backward"] == last["reduce_scatter"] == third
        assert last["scalars"] <= 64


def test_persistent_parameters_stay_whole_and_are_reported() -> None:
    opt = zr.SGD(lr=0.05, momentum=0.9)
    batches = _mlp_batches()
    ref, _ = single_process(MLP_FN, mse_loss, opt, batches, max_grad_norm=0.15)
    got, engines, sent = run_ranks(2, MLP_FN, mse_loss, opt, batches, accum=2, clip=0.15, persistence_threshold=17)
    assert _max_dev(got, ref) <= 1e-6
    memory = engines[0].memory_report()
    assert memory["persistent_numel"] == 3 * 16  # the three biases
    assert memory["persistent_params"] == memory["persistent_grads"] == 3 * 16 * 4
    assert memory["total"] == memory["held_storage_bytes"]
    assert sent[0][-1]["persistent_reduce_scatter"] == sent[0][-1]["persistent_all_gather"] == 48 // 2 * 4


def test_gathered_buffers_do_not_grow_with_the_number_of_units() -> None:
    reports = []
    for depth in (2, 6):
        fn = functools.partial(mlp, 16, depth)
        _, engines, _ = run_ranks(2, fn, mse_loss, zr.AdamW(), _mlp_batches(1))
        reports.append(engines[0].memory_report())
    assert reports[0]["units"] < reports[1]["units"]
    assert reports[0]["gather_buffers"] == reports[1]["gather_buffers"] > 0
    assert reports[0]["reduce_buffers"] == reports[1]["reduce_buffers"] > 0


def test_low_memory_init_trains_exactly_like_full_init() -> None:
    opt = zr.AdamW(lr=1e-3)
    batches = _gpt_batches()
    full, _, _ = run_ranks(2, GPT_FN, lm_loss, opt, batches)
    low, _, _ = run_ranks(2, GPT_FN, lm_loss, opt, batches, init="low_memory")
    assert _max_dev(full, low) == 0.0


def test_nested_units_need_buffers_for_their_nesting() -> None:
    policy = (torch.nn.Linear, "Block")  # each Linear inside a Block is a unit of its own
    with pytest.raises(zr.ConfigError, match="max_live_units=1 is below the unit nesting depth 2"):
        run_ranks(2, GPT_FN, lm_loss, zr.AdamW(), _gpt_batches(1), wrap_policy=policy, max_live_units=1)
    opt = zr.SGD(lr=0.05)
    ref, _ = single_process(GPT_FN, lm_loss, opt, _gpt_batches(2))
    got, engines, _ = run_ranks(2, GPT_FN, lm_loss, opt, _gpt_batches(2), wrap_policy=policy, max_live_units=2)
    assert _max_dev(got, ref) <= 1e-6
    assert engines[0].memory_report()["units"] == 1 + 2 * (1 + 4)  # root, 2 blocks and their 4 Linears


def test_a_forward_without_grad_between_steps_uses_the_trained_weights() -> None:
    opt = zr.AdamW(lr=1e-2)
    got, engines, _ = run_ranks(1, GPT_FN, lm_loss, opt, _gpt_batches(2))
    reference = GPT_FN()
    reference.load_state_dict(got, strict=False)  # head.weight is wte.weight
    tokens = _gpt_batches(1)[0][:, :-1]
    with torch.no_grad():
        out = engines[0].module(tokens)
    assert torch.allclose(out, reference(tokens), atol=1e-6)
    assert all(p.numel() == 0 for p in engines[0].module.parameters())  # freed again afterwards


def test_bf16_compute_keeps_fp32_masters_and_tracks_fp32() -> None:
    opt = zr.AdamW(lr=1e-3)
    ref, _ = single_process(MLP_FN, mse_loss, opt, _mlp_batches())
    got, engines, _ = run_ranks(2, MLP_FN, mse_loss, opt, _mlp_batches(), dtype="bfloat16")
    assert _max_dev(got, ref) <= 5e-3  # docs/numerics.md's bf16 tolerance
    memory = engines[0].memory_report()
    assert memory["optimizer_master"] == memory["params"] * 2  # fp32 masters of bf16 shards


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_0_2_gradients_live_for_one_step(stage: int) -> None:
    # Released after every update (zero_grad(set_to_none=True) semantics) and allocated afresh
    # for the next backward: training still equals one process, and memory_report() still
    # counts the step's peak, the paper's figure.
    opt = zr.AdamW(lr=1e-2, weight_decay=0.01)
    ref, _ = single_process(MLP_FN, mse_loss, opt, _mlp_batches())
    got, engines, _ = run_ranks(2, MLP_FN, mse_loss, opt, _mlp_batches(), accum=2, stage=stage)
    assert _max_dev(got, ref) <= 1e-6
    for engine in engines:
        groups = engine.state.groups
        assert not any(g.grads_held for g in groups)
        assert all(p.grad is None for p in engine.module.parameters())
        assert all(g.grads is None and g.grad_shard is None for g in groups)
        report = engine.memory_report()
        assert report["grads_between_steps"] == 0
        padded = engine.layout.padded_numel
        held = padded * 4 if stage < 2 else padded // 2 * 4  # full buffer, or this rank's half
        assert report["grads"] + report["padding_grads"] == held
