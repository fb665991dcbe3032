"""The flat-shard optimizers reproduce torch.optim element for element."""

from __future__ import annotations

import pytest
import torch

from zero_ray.core.optim import SGD, AdamW, takes_weight_decay, torch_optimizer
from zero_ray.errors import ConfigError


def _run_both(cfg: AdamW | SGD, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(6, 5)
    b = torch.randn(5)
    grads = [(torch.randn(6, 5), torch.randn(5)) for _ in range(steps)]
    ref = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    opt = torch_optimizer(cfg, [("layer.weight", ref[0]), ("layer.bias", ref[1])])
    flat = torch.cat([w.reshape(-1), b])
    state = {k: torch.zeros_like(flat) for k in cfg.state_names}
    for t, (gw, gb) in enumerate(grads, start=1):
        ref[0].grad, ref[1].grad = gw.clone(), gb.clone()
        opt.step()
        cfg.update(flat, torch.cat([gw.reshape(-1), gb]), state, step=t, lr=cfg.lr, decay=[(0, 30)])
    return torch.cat([ref[0].detach().reshape(-1), ref[1].detach()]), flat


@pytest.mark.parametrize("cfg", [
    AdamW(lr=1e-2, weight_decay=0.1),
    AdamW(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    SGD(lr=0.1),
    SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
    SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.02),
    SGD(lr=0.05, momentum=0.5, dampening=0.1),
])
def test_matches_torch_optim(cfg: AdamW | SGD) -> None:
    ref, ours = _run_both(cfg)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-7)


def test_default_weight_decay_rule_skips_biases_and_norm_weights() -> None:
    assert takes_weight_decay("fc.weight", (4, 4), None)
    assert not takes_weight_decay("fc.bias", (4,), None)
    assert not takes_weight_decay("ln.weight", (4,), None)
    assert takes_weight_decay("ln.weight", (4,), ("*.bias",))
    assert not takes_weight_decay("emb.weight", (4, 4), ("emb.*",))


@pytest.mark.parametrize(("factory", "match"), [
    (lambda: AdamW(lr=-1.0), "lr=-1.0"),
    (lambda: AdamW(betas=(0.9, 1.0)), "betas"),
    (lambda: AdamW(eps=0.0), "eps=0.0"),
    (lambda: SGD(lr=0.1, nesterov=True), "nesterov"),
    (lambda: SGD(weight_decay=-1.0), "weight_decay=-1.0"),
])
def test_bad_hyperparameters_name_the_value(factory, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        factory()
