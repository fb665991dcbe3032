"""The user's ``torch.optim`` optimizers, as a plan every partition owner can run.

A run takes ``optimizer``: a factory ``module -> torch.optim.Optimizer`` (or a list of them, e.g.
Muon for the hidden matrices and AdamW for the rest), written exactly as in one process. Every
owner calls the factories on its own copy of the module (parameters with their real shapes, on
the meta device where they are not materialised); ``plan_optimizers`` reads back which class
each optimizer is, its groups with their hyperparameters and which parameters each group holds.
The owners then run that class themselves (``owner/step/optimizer.py``) over what they update:

- element-wise classes (``torch.optim.SGD``, ``Adam``, ``AdamW``, ...: every state tensor is the
  parameter's shape and every update element-wise) over 1-D views of the fragments of the flat
  shard each owner owns, so the paper's partition holds, byte for byte;
- whole-tensor classes (``torch.optim.Muon``, ``Adafactor``: Newton-Schulz on whole matrices,
  factored row and column moments) over whole parameters, each on exactly one owner.

Unknown classes are refused unless the run declares them (``ZeroConfig(optimizer_kinds=...)``),
and so are classes that cannot run this way (LBFGS needs a closure, SparseAdam sparse gradients).

``zr.AdamW`` / ``zr.SGD`` are conveniences: factories that build torch's own with biases and 1-D
parameters (norm weights) in a group without weight decay.

No ray, no grpc.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero_ray.errors import ConfigError

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

FACTORY_FORM = ("optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=3e-4)  "
                "(or a list of such factories)")
SCHEDULER_FORM = ("lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-4, "
                  "total_steps=10_000)")


class UpdateKind(enum.Enum):
    """How an optimizer class may be run over a partition."""

    ELEMENTWISE = "elementwise"  # per element: any 1-D slice of a parameter updates like the whole
    WHOLE_TENSOR = "whole_tensor"  # needs whole parameters (matrix functions, factored moments)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
    torch.optim.Rprop,
)
_WHOLE_TENSOR: tuple[type, ...] = (torch.optim.Muon, torch.optim.Adafactor)
_REFUSED: dict[type, str] = {
    torch.optim.LBFGS: "it re-evaluates the loss through a closure several times per step, which a data-parallel "
                       "step cannot offer; use a first-order optimizer",
    torch.optim.SparseAdam: "it needs sparse gradients, and partitions reduce dense flat gradients; use "
                            "torch.optim.Adam or AdamW",
}
KNOWN: Mapping[str, UpdateKind] = {
    **{qualified_name(c): UpdateKind.ELEMENTWISE for c in _ELEMENTWISE},
    **{qualified_name(c): UpdateKind.WHOLE_TENSOR for c in _WHOLE_TENSOR},
}


def declared_kinds(value: Mapping[Any, Any] | None) -> tuple[tuple[str, str], ...]:
    """``ZeroConfig.optimizer_kinds`` normalised: ``{class or "module.Class": "elementwise" |
    "whole_tensor"}`` as sorted ``(qualified name, kind)`` pairs."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        value = dict(value)  # already normalised (a config rebuilt from its fields)
    if not isinstance(value, Mapping):
        raise ConfigError(f"optimizer_kinds={value!r} must be a mapping {{optimizer class: 'elementwise' | "
                          "'whole_tensor'}}, e.g. {Lion: 'elementwise'}")
    out = []
    kinds = [k.value for k in UpdateKind]
    for cls, kind in value.items():
        name = qualified_name(cls) if isinstance(cls, type) else cls
        if not isinstance(name, str) or not name:
            raise ConfigError(f"optimizer_kinds key {cls!r} must be an optimizer class or its 'module.Class' name")
        if kind not in kinds:
            raise ConfigError(f"optimizer_kinds[{name!r}]={kind!r} is not one of {kinds}")
        out.append((name, kind))
    return tuple(sorted(out))


def update_kind(cls: type, declared: Sequence[tuple[str, str]] = ()) -> UpdateKind:
    """How optimizer class ``cls`` runs; raises ConfigError for refused and unknown classes."""
    if cls in _REFUSED:
        raise ConfigError(f"{cls.__name__} cannot train under ZeRO: {_REFUSED[cls]}")
    name = qualified_name(cls)
    for declared_name, kind in declared:
        if declared_name == name:
            return UpdateKind(kind)
    if name in KNOWN:
        return KNOWN[name]
    raise ConfigError(
        f"optimizer class {name} is not one zero_ray knows how to partition. If its update is element-wise (every "
        "state tensor shaped like its parameter, each element updated from the same element of the gradient) "
        f"declare ZeroConfig(optimizer_kinds={{{cls.__name__}: 'elementwise'}}); if it needs whole parameters "
        f"(matrix functions, factored statistics) declare {{{cls.__name__}: 'whole_tensor'}}. Known: "
        f"{', '.join(sorted(n.rsplit('.', 1)[-1] for n in KNOWN))}")


def check_optimizer_factories(value: object) -> tuple[OptimizerFactory, ...]:
    """The run's optimizer factories; anything else is a ConfigError showing the lambda form."""
    factories = list(value) if isinstance(value, (list, tuple)) else [value]
    if not factories:
        raise ConfigError(f"optimizer={value!r} names no factory; pass {FACTORY_FORM}")
    for f in factories:
        if isinstance(f, torch.optim.Optimizer):
            raise ConfigError(f"optimizer={type(f).__name__}(...) is an optimizer built in this process; every "
                              f"partition owner builds its own over its own module, so pass a factory: {FACTORY_FORM}")
        if isinstance(f, type) or not callable(f):
            raise ConfigError(f"optimizer={f!r} is not a factory module -> torch.optim.Optimizer; pass {FACTORY_FORM}")
    return tuple(factories)


def check_scheduler_factory(value: object) -> SchedulerFactory | None:
    if value is None:
        return None
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler) or isinstance(value, type) or not callable(value):
        raise ConfigError(f"lr_scheduler={value!r} is not a factory optimizer -> LRScheduler; pass {SCHEDULER_FORM}")
    return value  # type: ignore[return-value]


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One of the user's param groups: its hyperparameters and its parameters (indices into
    ``module.named_parameters()``, which are the layout's parameter indices)."""

    hyper: Mapping[str, Any]
    params: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class OptimizerPlan:
    """One of the user's optimizers: its class, how it runs, constructor defaults and groups."""

    index: int
    cls: type
    kind: UpdateKind
    defaults: Mapping[str, Any]
    groups: tuple[GroupPlan, ...]

    def build(self, groups: Sequence[Sequence[torch.Tensor]]) -> torch.optim.Optimizer:
        """An instance of the user's class over ``groups[k]`` in place of group ``k``'s
        parameters, with every group's hyperparameters (a group may be empty here)."""
        accepted = inspect.signature(self.cls.__init__).parameters
        kwargs = {k: v for k, v in self.defaults.items() if k in accepted}
        param_groups = [{**g.hyper, "params": list(tensors)} for g, tensors in zip(self.groups, groups)]
        return self.cls(param_groups, **kwargs)


@dataclass(frozen=True, kw_only=True)
class OptimizersPlan:
    """Every optimizer of the run and which one updates each parameter (None: frozen, or left
    out of every optimizer, which torch leaves as it is)."""

    optimizers: tuple[OptimizerPlan, ...]
    of_param: tuple[int | None, ...]

    def kind_of(self, param: int) -> UpdateKind | None:
        o = self.of_param[param]
        return None if o is None else self.optimizers[o].kind

    def records(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """JSON data naming each optimizer's class and groups (parameters by name): what a
        checkpoint's manifest records, and what ``RecordedOptimizers`` rebuilds."""
        return [{"type": qualified_name(o.cls), "kind": o.kind.value, "defaults": jsonable(o.defaults),
                 "groups": [{"hyper": jsonable(g.hyper), "params": [names[i] for i in g.params]} for g in o.groups]}
                for o in self.optimizers]


def plan_optimizers(factories: Sequence[OptimizerFactory], module: nn.Module, *,
                    declared: Sequence[tuple[str, str]] = ()) -> OptimizersPlan:
    """Call each factory on ``module`` and read its optimizer back as a plan. Parameters are
    identified as ``module.named_parameters()`` lists them; frozen ones in a group are dropped
    (torch never steps a parameter without a gradient)."""
    named = list(module.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    of_param: list[int | None] = [None] * len(named)
    plans = []
    for k, factory in enumerate(factories):
        try:
            opt = factory(module)
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(f"the optimizer factory {factory!r} failed on the model: {type(err).__name__}: {err}. "
                              f"It is called as factory(model) on every partition owner: {FACTORY_FORM}") from err
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory {factory!r} returned {type(opt).__name__}, not a "
                              f"torch.optim.Optimizer; pass {FACTORY_FORM}")
        kind = update_kind(type(opt), declared)
        groups = []
        for group in opt.param_groups:
            members = []
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:
                    raise ConfigError(f"{type(opt).__name__} (optimizer {k}) holds a tensor of shape {tuple(p.shape)} "
                                      "that is not a parameter of the model the factory was given; build its groups "
                                      "from model.parameters() or model.named_parameters()")
                if not named[i][1].requires_grad:
                    continue
                if of_param[i] is not None:
                    raise ConfigError(f"parameter {named[i][0]!r} is in optimizer {of_param[i]} and optimizer {k}: "
                                      "each parameter may be stepped by one optimizer only")
                of_param[i] = k
                members.append(i)
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append(GroupPlan(hyper=hyper, params=tuple(members)))
        plans.append(OptimizerPlan(index=k, cls=type(opt), kind=kind, defaults=dict(opt.defaults),
                                   groups=tuple(groups)))
        del opt  # built over the module's own parameters: only its description is kept
    return OptimizersPlan(optimizers=tuple(plans), of_param=tuple(of_param))


def jsonable(value: Any) -> Any:
    """Hyperparameters and scheduler state as JSON data: tuples as lists, 0-d tensors as numbers."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _load_class(name: str) -> type:
    module, _, attr = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"optimizer class {name} cannot be imported here ({err}); pass the optimizer factory "
                          "explicitly") from err
    return obj


def _restore_tuples(cls: type, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """JSON lists back to the tuples a constructor's defaults use (betas, etas, ...)."""
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    return {k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple) else v for k, v in hyper.items()}


def recorded_factories(records: Sequence[Mapping[str, Any]]) -> tuple[OptimizerFactory, ...]:
    """Factories rebuilding the optimizers a checkpoint recorded (class, groups by parameter
    name, hyperparameters as built): what ``from_checkpoint`` runs when no optimizer is passed."""
    return tuple(RecordedOptimizer(r) for r in records)


@dataclass(frozen=True)
class RecordedOptimizer:
    """A factory of one recorded optimizer (see ``recorded_factories``)."""

    record: Mapping[str, Any]

    def __call__(self, module: nn.Module) -> torch.optim.Optimizer:
        cls = _load_class(str(self.record["type"]))
        named = dict(module.named_parameters())
        missing = sorted({n for g in self.record["groups"] for n in g["params"]} - set(named))
        if missing:
            raise ConfigError(f"the recorded {cls.__name__} names parameters the model lacks: {missing[:5]}")
        groups = [{**_restore_tuples(cls, g["hyper"]), "params": [named[n] for n in g["params"]]}
                  for g in self.record["groups"]]
        accepted = inspect.signature(cls.__init__).parameters
        defaults = _restore_tuples(cls, {k: v for k, v in self.record["defaults"].items() if k in accepted})
        return cls(groups, **defaults)


# -- conveniences: factories that build torch's own ------------------------------------------------
def _check_patterns(no_decay: tuple[str, ...] | None) -> None:
    if no_decay is not None and not all(isinstance(p, str) for p in no_decay):
        raise ConfigError(f"{no_decay=} must be a tuple of fnmatch patterns over parameter names")


def takes_weight_decay(name: str, shape: tuple[int, ...], no_decay: tuple[str, ...] | None) -> bool:
    """Default rule: biases and 1-D parameters (norm weights) take no weight decay; with
    ``no_decay`` patterns given, exactly the parameters whose names match none of them do."""
    if no_decay is None:
        return len(shape) >= 2 and not name.endswith("bias")
    return not any(fnmatch.fnmatchcase(name, pat) for pat in no_decay)


def decay_groups(module: nn.Module, weight_decay: float, no_decay: tuple[str, ...] | None) -> list[dict[str, Any]]:
    """``module``'s trainable parameters as torch param groups: those taking weight decay, then
    the rest with ``weight_decay=0`` (empty groups left out)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if takes_weight_decay(n, tuple(p.shape), no_decay)]
    rest = [p for n, p in named if not takes_weight_decay(n, tuple(p.shape), no_decay)]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
            if g["params"]]


def _check_lr(name: str, lr: float) -> None:
    if not (lr >= 0 and math.isfinite(lr)):
        raise ConfigError(f"{name} lr={lr!r} must be a finite number >= 0")


@dataclass(frozen=True, kw_only=True)
class AdamW:
    """A factory of ``torch.optim.AdamW`` (its defaults) with biases and 1-D parameters in a
    group without weight decay (``no_decay``: fnmatch patterns naming that group instead)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    no_decay: tuple[str, ...] | None = None
    foreach: bool | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        _check_lr("AdamW", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"AdamW {self.betas=} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"AdamW {self.eps=} must be > 0")
        if not self.weight_decay >= 0:
            raise ConfigError(f"AdamW {self.weight_decay=} must be >= 0")
        _check_patterns(self.no_decay)

    def __call__(self, module: nn.Module) -> torch.optim.AdamW:
        return torch.optim.AdamW(decay_groups(module, self.weight_decay, self.no_decay), lr=self.lr, betas=self.betas,
                                 eps=self.eps, foreach=self.foreach, fused=self.fused)


@dataclass(frozen=True, kw_only=True)
class SGD:
    """A factory of ``torch.optim.SGD`` (optional Nesterov momentum, coupled weight decay) with
    biases and 1-D parameters in a group without weight decay, as ``AdamW``."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] | None = None
    foreach: bool | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        _check_lr("SGD", self.lr)
        if not 0.0 <= self.momentum < 1.0 + 1e-12:
            raise ConfigError(f"SGD {self.momentum=} must be in [0, 1]")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(f"SGD nesterov needs momentum > 0 and dampening 0 ({self.momentum=}, {self.dampening=})")
        if not self.weight_decay >= 0:
            raise ConfigError(f"SGD {self.weight_decay=} must be >= 0")
        _check_patterns(self.no_decay)

    def __call__(self, module: nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(decay_groups(module, self.weight_decay, self.no_decay), lr=self.lr,
                               momentum=self.momentum, dampening=self.dampening, nesterov=self.nesterov,
                               foreach=self.foreach, fused=self.fused)
