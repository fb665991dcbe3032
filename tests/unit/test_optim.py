"""The optimizer plan (pure): the conveniences build torch's own, the registry says how each class
runs under a partition, factories are read back as classes, groups and hyperparameters, and
anything that is not a factory is refused with the lambda form."""

from __future__ import annotations

import json

import pytest
import torch

from zero_ray.core.optimizer_plan import (
    SGD,
    AdamW,
    UpdateKind,
    check_optimizer_factories,
    check_scheduler_factory,
    declared_kinds,
    plan_optimizers,
    recorded_factories,
    takes_weight_decay,
    update_kind,
)
from zero_ray.core.lr_schedule import WarmupCosine
from zero_ray.errors import ConfigError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    model[1].weight.requires_grad_(False)  # frozen: dropped from every group
    return model


def test_conveniences_build_torch_optimizers_with_decay_groups() -> None:
    opt = AdamW(lr=3e-4, weight_decay=0.1, fused=True)(_model())
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 3]  # the two weights; the biases and LN bias
    sgd = SGD(lr=0.1, momentum=0.9, nesterov=True, no_decay=("*.bias",))(_model())
    assert type(sgd) is torch.optim.SGD and sgd.defaults["nesterov"] is True


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


def test_the_registry() -> None:
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop):
        assert update_kind(cls) is UpdateKind.ELEMENTWISE
    assert update_kind(torch.optim.Muon) is update_kind(torch.optim.Adafactor) is UpdateKind.WHOLE_TENSOR
    with pytest.raises(ConfigError, match="LBFGS cannot train under ZeRO: it re-evaluates the loss through a closure"):
        update_kind(torch.optim.LBFGS)
    with pytest.raises(ConfigError, match="SparseAdam cannot train under ZeRO: it needs sparse gradients"):
        update_kind(torch.optim.SparseAdam)

    class Lion(torch.optim.Optimizer):
        pass

    with pytest.raises(ConfigError, match=r"declare ZeroConfig\(optimizer_kinds=\{Lion: 'elementwise'\}\)"):
        update_kind(Lion)
    declared = declared_kinds({Lion: "whole_tensor"})
    assert update_kind(Lion, declared) is UpdateKind.WHOLE_TENSOR
    assert declared_kinds(declared) == declared  # normalised form passes through
    with pytest.raises(ConfigError, match="'sometimes' is not one of"):
        declared_kinds({Lion: "sometimes"})


def test_anything_but_a_factory_is_refused_with_the_lambda_form() -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"is an optimizer built in this process.*optimizer=lambda model: "):
        check_optimizer_factories(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="optimizer=<class 'torch.optim.adamw.AdamW'> is not a factory"):
        check_optimizer_factories(torch.optim.AdamW)
    with pytest.raises(ConfigError, match="names no factory"):
        check_optimizer_factories([])
    assert len(check_optimizer_factories([AdamW(), SGD()])) == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"lr_scheduler=.* is not a factory optimizer -> LRScheduler"):
        check_scheduler_factory(torch.optim.lr_scheduler.StepLR(opt, 3))
    with pytest.raises(ConfigError, match="the optimizer factory .* returned str"):
        plan_optimizers([lambda m: "adam"], model)
    with pytest.raises(ConfigError, match=r"failed on the model: TypeError"):
        plan_optimizers([lambda m: torch.optim.SGD(m.parameters(), lr=0.1, bogus=1)], model)


def test_a_plan_reads_the_users_groups_back() -> None:
    model = _model()
    named = [n for n, _ in model.named_parameters()]

    def factory(m: torch.nn.Module) -> torch.optim.Optimizer:
        params = dict(m.named_parameters())
        return torch.optim.Adam([{"params": [params["0.weight"], params["2.weight"]], "lr": 0.1},
                                 {"params": [params["0.bias"], params["1.weight"]], "betas": (0.5, 0.6)}], lr=0.01)

    plan = plan_optimizers([factory, lambda m: torch.optim.SGD([m[1].bias, m[2].bias], lr=0.2)], model)
    adam, sgd = plan.optimizers
    assert [g.params for g in adam.groups] == [(0, 4), (1,)]  # the frozen LN weight is dropped
    assert adam.groups[0].hyper["lr"] == 0.1 and adam.groups[1].hyper["betas"] == (0.5, 0.6)
    assert plan.of_param == (0, 0, None, 1, 0, 1)
    assert plan.kind_of(3) is UpdateKind.ELEMENTWISE and plan.kind_of(2) is None
    records = json.loads(json.dumps(plan.records(named)))  # JSON data, as a manifest stores it
    assert records[0]["groups"][1] == {"hyper": records[0]["groups"][1]["hyper"], "params": ["0.bias"]}
    rebuilt = plan_optimizers(recorded_factories(records), model)
    assert [(o.cls, [g.params for g in o.groups]) for o in rebuilt.optimizers] == \
           [(o.cls, [g.params for g in o.groups]) for o in plan.optimizers]
    assert rebuilt.optimizers[0].groups[1].hyper["betas"] == (0.5, 0.6)  # tuples come back as tuples
    with pytest.raises(ConfigError, match="is in optimizer 0 and optimizer 1"):
        plan_optimizers([factory, factory], model)
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        plan_optimizers([lambda m: torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)], model)


def test_a_plan_sees_real_shapes_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(8, 4)
    plan = plan_optimizers([lambda m: torch.optim.Muon([m.weight], lr=0.02)], model)  # Muon checks ndim == 2
    assert plan.of_param == (0, None)


def test_warmup_cosine_builds_lambda_lr() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = WarmupCosine(warmup_steps=2, total_steps=6, min_ratio=0.1)(opt)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lrs[-1] > 0.1 and lrs == sorted(lrs[:3]) + sorted(lrs[2:], reverse=True)[1:]
    with pytest.raises(ConfigError, match="total_steps"):
        WarmupCosine(warmup_steps=5, total_steps=5)
