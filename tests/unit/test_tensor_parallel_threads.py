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


class OldStyleAttention(nn.Module):
    """Attention as transformers 4.3x wrote it: head counts kept on the module and read by the
    views in forward (``shard_model`` divides them by T), grouped-query by repeat_interleave."""

    def __init__(self, width: int = 16, heads: int = 8, kv_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, heads * self.head_dim)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim)
        self.o_proj = nn.Linear(heads * self.head_dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1) @ v
        return x + self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class OldStyleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = OldStyleAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.inp(x))


OLD_STYLE_PLAN = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                  "attn.o_proj": "rowwise"}


Case = tuple[Callable[[], nn.Module], Callable[[], Any], Callable[[nn.Module, Any], torch.Tensor], Any]
CASES: dict[str, Case] = {
    "llama-gqa-sdpa": (llama, lm_batch, lm_loss, None),
    "llama-gqa-eager": (lambda: llama("eager"), lm_batch, lm_loss, None),
    "qwen2": (qwen2, lm_batch, lm_loss, None),
    "plain-user-plan": (PlainNet, plain_batch, plain_loss, PLAIN_PLAN),
    "old-style-attention": (OldStyleNet, plain_batch, plain_loss, OLD_STYLE_PLAN),
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


def test_head_counts_kept_on_an_attention_module_are_divided_by_the_size() -> None:
    models: list[OldStyleNet] = []

    def rank_main(group: ThreadGroup) -> None:
        model = OldStyleNet()
        shard_model(model, TensorParallel(size=2, plan=OLD_STYLE_PLAN), group)
        models.append(model)

    on_threads(2, rank_main)
    assert [(m.attn.num_heads, m.attn.num_key_value_heads, m.attn.head_dim) for m in models] == [(4, 2, 2)] * 2


@pytest.mark.parametrize(("name", "size"), [("llama-gqa-sdpa", 2), ("plain-user-plan", 4)])
def test_three_sgd_steps_on_the_shards_follow_single_process_torch(name: str, size: int) -> None:
    build, batch_fn, loss_fn, plan = CASES[name]
    torch.manual_seed(0)
    ref = build()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(ref, batch_fn()).backward()
        opt.step()
    models = [build() for _ in range(size)]
    for m in models:
        m.load_state_dict(state)

    def rank_main(group: ThreadGroup) -> dict[str, torch.Tensor]:
        model = models[group.rank]
        shard_model(model, TensorParallel(size=size, plan=plan), group)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            loss_fn(model, batch_fn()).backward()
            opt.step()
        return full_tensors(model, dict(model.named_parameters()))

    want = dict(ref.named_parameters())
    for got in on_threads(size, rank_main):
        assert _max_dev(got, want) <= TOLERANCE


def test_a_model_on_the_meta_device_is_sharded_without_memory() -> None:
    from test_tensor_parallel_plan import tiny_llama

    models = [tiny_llama(), tiny_llama()]
    on_threads(2, lambda g: shard_model(models[g.rank], TensorParallel(size=2), g))
    q = models[1].model.layers[0].self_attn.q_proj
    assert isinstance(q, ShardedLinear) and q.weight.is_meta and q.weight.shape == (16, 32)
    with pytest.raises(ValueError, match="already sharded"):
        on_threads(2, lambda g: shard_model(models[g.rank], TensorParallel(size=2), g))


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


def test_llama_tp_traffic_is_one_all_reduce_per_rowwise_forward_and_colwise_input_backward() -> None:
    # 2 blocks x (o_proj, down_proj) in forward + 2 x (q/k/v's input, gate/up's input) in backward,
    # each over the batch's activations; the ring's 2 (T-1)/T of them per all-reduce. Megatron's
    # count: q, k and v share one f (SharedInput), their gradients added before the one sum (with
    # an f per layer it was 4 + 10 all-reduces).
    size = 2
    state, _, _ = _reference(CASES["llama-gqa-sdpa"])
    ranks, models = _sharded(CASES["llama-gqa-sdpa"], size, state)
    activations = BATCH * SEQ * 32 * 4
    assert [sent for *_, sent in ranks] == [(4 + 4) * 2 * (size - 1) * activations // size] * size
    attention = models[0].model.layers[0].self_attn
    assert attention.q_proj.shared is attention.k_proj.shared is attention.v_proj.shared is not None
    assert attention.o_proj.shared is None  # rowwise: its g is its own
    assert attention.q_proj.shared._open is None  # the forward's inputs are not held after it


def test_size_one_changes_nothing() -> None:
    model = PlainNet()
    before = {n: p for n, p in model.named_parameters()}
    plan = on_threads(1, lambda g: shard_model(model, TensorParallel(size=1, plan=PLAIN_PLAN), g))[0]
    assert len(plan.shards) == 4  # resolved and checked, not applied
    assert {n: p for n, p in model.named_parameters()} == before
    assert not any(isinstance(m, ShardedLinear) for m in model.modules())
