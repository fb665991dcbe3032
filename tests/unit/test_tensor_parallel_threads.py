"""Tensor-parallel sharding on thread ranks (issue 45): a model split over T = 2 and T = 4 ranks
by its plan computes single-process torch's loss and every parameter's gradient (gathered back
to its whole shape) within 1e-5 in fp32: a Hugging Face Llama with grouped-query attention and
its own plan (eager and SDPA attention), a Qwen2 (biased q/k/v projections) with its own plan,
and a plain module with a user's plan. The ranks are threads over the in-memory Collective
(tests/thread_ranks.py); wiring TP groups into the owners' ZeRO partitioning comes later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from test_tensor_parallel_plan import PLAIN_PLAN, PlainNet
from thread_ranks import ThreadGroup, on_threads
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.owner.construction.tensor_sharding import ShardedLinear, full_tensors, shard_model

TOLERANCE = 1e-5
VOCAB, BATCH, SEQ = 96, 2, 12


def llama(attn: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # 8 query heads over 4 key/value heads: at T = 4 each rank holds 2 query heads and 1 kv head
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         attn_implementation=attn)
    return LlamaForCausalLM(config)


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return Qwen2ForCausalLM(config)


def lm_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def plain_batch() -> torch.Tensor:
    return torch.randn(BATCH, 5, 8, generator=torch.Generator().manual_seed(2))


def plain_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


Case = tuple[Callable[[], nn.Module], Callable[[], Any], Callable[[nn.Module, Any], torch.Tensor], Any]
CASES: dict[str, Case] = {
    "llama-gqa-sdpa": (llama, lm_batch, lm_loss, None),
    "llama-gqa-eager": (lambda: llama("eager"), lm_batch, lm_loss, None),
    "qwen2": (qwen2, lm_batch, lm_loss, None),
    "plain-user-plan": (PlainNet, plain_batch, plain_loss, PLAIN_PLAN),
}


def _reference(case: Case) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    build, batch_fn, loss_fn, _ = case
    torch.manual_seed(0)
    model = build()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss = loss_fn(model, batch_fn())
    loss.backward()
    return state, loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _sharded(case: Case, size: int, state: dict[str, torch.Tensor]) -> tuple[list[Any], list[nn.Module]]:
    build, batch_fn, loss_fn, plan = case
    # Built on the test thread: transformers' construction contexts are process-wide.
    models = [build() for _ in range(size)]
    for m in models:
        m.load_state_dict(state)

    def rank_main(group: ThreadGroup) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        model = models[group.rank]
        shard_model(model, TensorParallel(size=size, plan=plan), group)
        loss = loss_fn(model, batch_fn())
        loss.backward()
        sent = group.counters.snapshot().get("all_reduce", 0)
        grads = full_tensors(model, {n: p.grad for n, p in model.named_parameters()})
        values = full_tensors(model, dict(model.named_parameters()))
        return loss.item(), grads, values, sent

    return on_threads(size, rank_main), models


def _max_dev(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_loss_and_gradients_equal_single_process_torch(name: str, size: int) -> None:
    case = CASES[name]
    state, want_loss, want_grads = _reference(case)
    ranks, models = _sharded(case, size, state)
    for loss, grads, values, _ in ranks:
        assert abs(loss - want_loss) <= TOLERANCE
        assert _max_dev(grads, want_grads) <= TOLERANCE
        # the slices gathered back are the weights each rank started from
        assert _max_dev(values, {n: state[n] for n in values}) == 0.0
    # each rank held 1/T of every sharded weight, and the plan sharded something
    sharded = [m for m in models[0].modules() if isinstance(m, ShardedLinear)]
    assert sharded
    for module in sharded:
        out_full, in_full = module.full_shape
        assert module.weight.shape == ((out_full // size, in_full) if module.style == "colwise"
                                       else (out_full, in_full // size))


def test_llama_tp_traffic_is_one_all_reduce_per_rowwise_forward_and_colwise_backward() -> None:
    # 2 blocks x (o_proj, down_proj) in forward + 2 x (q, k, v, gate, up) in backward, each over
    # the batch's activations; the ring's 2 (T-1)/T of them per all-reduce. (q, k and v share an
    # input: one summed gradient would do for the three; a later optimisation.)
    size = 2
    state, _, _ = _reference(CASES["llama-gqa-sdpa"])
    ranks, _ = _sharded(CASES["llama-gqa-sdpa"], size, state)
    activations = BATCH * SEQ * 32 * 4
    assert [sent for *_, sent in ranks] == [(4 + 10) * 2 * (size - 1) * activations // size] * size


def test_size_one_changes_nothing() -> None:
    model = PlainNet()
    before = {n: p for n, p in model.named_parameters()}
    plan = on_threads(1, lambda g: shard_model(model, TensorParallel(size=1, plan=PLAIN_PLAN), g))[0]
    assert len(plan.shards) == 4  # resolved and checked, not applied
    assert {n: p for n, p in model.named_parameters()} == before
    assert not any(isinstance(m, ShardedLinear) for m in model.modules())
