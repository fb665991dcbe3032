"""Low-memory construction (zero_ray.owner.construction.materialize): which initialisations it reproduces
bit for bit, and which it refuses. Pure torch, no Ray."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from zero_ray.errors import ModelError
from zero_ray.models import GPT, GPTConfig, mlp
from zero_ray.owner.construction.materialize import build_recorded


class ManyInits(nn.Module):
    """Default reset_parameters, explicit nn.init calls, partial writes, RNG-drawing buffers
    between parameters, a parameter from torch.randn, copies from real tables."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)  # normal_ then a partial fill_
        self.register_buffer("noise", torch.randn(5))  # draws between two parameters
        self.pos = nn.Parameter(torch.randn(3, 4) * 0.02)  # its value at registration is kept
        self.lin = nn.Linear(4, 6)
        nn.init.trunc_normal_(self.lin.weight, std=0.02)  # skips meta tensors inside torch
        self.conv = nn.Conv2d(2, 3, 3)
        nn.init.xavier_uniform_(self.conv.weight)
        self.square = nn.Linear(4, 4, bias=False)
        nn.init.orthogonal_(self.square.weight)  # works on temporaries inside torch
        self.ln = nn.LayerNorm(6)
        self.bn = nn.BatchNorm1d(4)
        with torch.no_grad():
            self.lin.weight[:2].mul_(0.5)
            self.ln.bias.copy_(torch.arange(6.0))
            self.conv.bias.data.uniform_(-1, 1)  # through .data
        nn.init.kaiming_normal_(self.conv.weight[:, :1])  # on a view
        nn.init.normal_(self.emb.weight, generator=torch.Generator().manual_seed(7))


def _post_init_model() -> nn.Module:
    model = mlp(8, 3)
    model.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, nn.Linear) else None)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": functools.partial(mlp, 16, 3),
    "gpt_tied_post_init": functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                                           n_embd=32)),
    "many_inits": ManyInits,
    "apply_after_construction": _post_init_model,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_low_memory_construction_reproduces_the_ordinary_one_bit_for_bit(name: str) -> None:
    model_fn = MODELS[name]
    torch.manual_seed(0)
    reference = model_fn()
    after_reference = torch.rand(4)
    module, recorder = build_recorded(model_fn, seed=0)
    after = torch.rand(4)
    assert torch.equal(after, after_reference)  # the random stream ends where it would
    for (n, p), (m, q) in zip(reference.named_parameters(), module.named_parameters(), strict=True):
        assert n == m and q.is_meta and q.shape == p.shape
        assert torch.equal(recorder.recipe_for(q).materialize(), p.detach()), n
    for (n, b), (_, c) in zip(reference.named_buffers(), module.named_buffers(), strict=True):
        assert torch.equal(b, c), n


def _randn_like() -> nn.Module:
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.randn_like(lin.weight))
    return lin


def _copy_from_parameter() -> nn.Module:
    model = mlp(4, 2)
    with torch.no_grad():
        model[2].weight.copy_(model[0].weight)
    return model


def _buffer_from_parameter() -> nn.Module:
    lin = nn.Linear(4, 4)
    lin.register_buffer("w0", lin.weight.detach().clone())
    return lin


def _meta_parameter() -> nn.Module:
    lin = nn.Linear(4, 4)
    lin.extra = nn.Parameter(torch.empty(3))
    lin._parameters["extra"] = nn.Parameter(torch.empty(3, device="meta"))
    return lin


@pytest.mark.parametrize(("model_fn", "message"), [
    (_randn_like, "randn_like"),
    (_copy_from_parameter, "operand is another parameter"),
    (_buffer_from_parameter, r"buffers \['w0'\]"),
])
def test_what_cannot_be_replayed_is_refused_with_a_reason(model_fn: Callable[[], nn.Module], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        build_recorded(model_fn, seed=0)


def test_a_parameter_created_on_meta_by_model_fn_is_refused_when_materialised() -> None:
    module, recorder = build_recorded(_meta_parameter, seed=0)
    with pytest.raises(ModelError, match="created on the meta device"):
        recorder.recipe_for(module.extra)


def test_structure_only_draws_nothing_for_parameters() -> None:
    torch.manual_seed(0)
    torch.rand(0)
    expected = torch.rand(3)  # nothing but buffers would draw: mlp has none
    module, _ = build_recorded(functools.partial(mlp, 16, 3), seed=0, record=False)
    assert all(p.is_meta for p in module.parameters())
    assert torch.equal(torch.rand(3), expected)
