"""Optimizers over flat shards, with the element-wise arithmetic of ``torch.optim``.

An optimizer here is a frozen config that also knows how to update one flat fp32 slice:
``update(param, grad, state, step=, lr=, decay=)`` where ``decay`` lists the ``[start, end)``
ranges of the slice whose parameters take weight decay. The operations and their order follow
``torch.optim.AdamW`` / ``torch.optim.SGD`` (single-tensor implementation), so a shard updated
here matches the same elements updated by torch in one process.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch

from zero_ray.errors import ConfigError

Ranges = Sequence[tuple[int, int]]


def _check_patterns(no_decay: tuple[str, ...] | None) -> None:
    if no_decay is not None and not all(isinstance(p, str) for p in no_decay):
        raise ConfigError(f"{no_decay=} must be a tuple of fnmatch patterns over parameter names")


def takes_weight_decay(name: str, shape: tuple[int, ...], no_decay: tuple[str, ...] | None) -> bool:
    """Default rule: biases and 1-D parameters (norm weights) take no weight decay; with
    ``no_decay`` patterns given, exactly the parameters whose names match none of them do."""
    if no_decay is None:
        return len(shape) >= 2 and not name.endswith("bias")
    return not any(fnmatch.fnmatchcase(name, pat) for pat in no_decay)


class Optimizer(Protocol):
    """What the partition owner needs from an optimizer config."""

    lr: float
    weight_decay: float
    no_decay: tuple[str, ...] | None

    @property
    def state_names(self) -> tuple[str, ...]: ...

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
               step: int, lr: float, decay: Ranges) -> None: ...


@dataclass(frozen=True, kw_only=True)
class AdamW:
    """AdamW (decoupled weight decay) with ``torch.optim.AdamW``'s defaults and arithmetic."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    no_decay: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"AdamW {self.lr=} must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"AdamW {self.betas=} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"AdamW {self.eps=} must be > 0")
        if not self.weight_decay >= 0:
            raise ConfigError(f"AdamW {self.weight_decay=} must be >= 0")
        _check_patterns(self.no_decay)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
               step: int, lr: float, decay: Ranges) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay != 0:
            for start, end in decay:
                param[start:end].mul_(1 - lr * self.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


@dataclass(frozen=True, kw_only=True)
class SGD:
    """SGD with optional (Nesterov) momentum and coupled weight decay, as ``torch.optim.SGD``."""

    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError(f"SGD {self.lr=} must be a finite number >= 0")
        if not 0.0 <= self.momentum < 1.0 + 1e-12:
            raise ConfigError(f"SGD {self.momentum=} must be in [0, 1]")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(f"SGD nesterov needs momentum > 0 and dampening 0 ({self.momentum=}, {self.dampening=})")
        if not self.weight_decay >= 0:
            raise ConfigError(f"SGD {self.weight_decay=} must be >= 0")
        _check_patterns(self.no_decay)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
               step: int, lr: float, decay: Ranges) -> None:
        if self.weight_decay != 0:
            # torch adds weight_decay * param to the gradient (coupled decay); the gradient
            # slice is scratch space here, so it is updated in place.
            for start, end in decay:
                grad[start:end].add_(param[start:end], alpha=self.weight_decay)
        if self.momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(grad)  # torch starts the buffer as a clone of the first gradient
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(grad, alpha=-lr)


def torch_optimizer(config: AdamW | SGD, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer that ``config`` reproduces, with the same weight-decay
    groups: the single-process reference and the PyTorch baselines use it."""
    decay = [p for n, p in named_parameters if takes_weight_decay(n, tuple(p.shape), config.no_decay)]
    rest = [p for n, p in named_parameters if not takes_weight_decay(n, tuple(p.shape), config.no_decay)]
    groups = [g for g in ({"params": decay, "weight_decay": config.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    if isinstance(config, AdamW):
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
    if isinstance(config, SGD):
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, dampening=config.dampening,
                               nesterov=config.nesterov)
    raise ConfigError(f"no torch optimizer for {config!r}")


_OPTIMIZERS: dict[str, type[AdamW] | type[SGD]] = {"AdamW": AdamW, "SGD": SGD}


def optimizer_record(config: AdamW | SGD) -> dict[str, object]:
    """``config`` as plain JSON data (what a checkpoint's manifest stores)."""
    data: dict[str, object] = {"type": type(config).__name__}
    for f in fields(config):
        value = getattr(config, f.name)
        data[f.name] = list(value) if isinstance(value, tuple) else value
    return data


def optimizer_from_record(data: dict[str, object]) -> AdamW | SGD:
    """The optimizer config ``optimizer_record`` described."""
    kind = data.get("type")
    cls = _OPTIMIZERS.get(str(kind))
    if cls is None:
        raise ConfigError(f"optimizer type={kind!r} is not one of {sorted(_OPTIMIZERS)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "type"}
    return cls(**values)  # type: ignore[arg-type]
