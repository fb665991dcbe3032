"""What a step changes besides its update, kept so that a step not taken changes nothing.

A step whose loss or gradients are non-finite (``ZeroConfig.on_nonfinite``) never reaches the
optimizer, but its forward has already drawn from the RNG streams (dropout) and updated the
module's buffers in place (BatchNorm's running statistics, which a NaN batch poisons). So each
step starts with a ``StepGuard``: the RNG states and a copy of the persistent buffers (what a
checkpoint holds; typically a few kilobytes), put back when the step is not taken. The same RNG
functions save and restore a checkpoint's ``rng/torch`` and ``rng/cuda`` entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class CudaRng(Protocol):
    """The part of ``torch.cuda`` the RNG functions use (a fake in tests without a GPU)."""

    def is_initialized(self) -> bool: ...

    def get_rng_state(self, device: Any = ...) -> torch.Tensor: ...

    def set_rng_state(self, new_state: torch.Tensor, device: Any = ...) -> None: ...


def rng_states(device: torch.device, *, cuda: CudaRng = torch.cuda) -> dict[str, torch.Tensor]:
    """This process's RNG states, by name: ``torch`` (the CPU generator) and, on a GPU owner
    where CUDA is initialised, ``cuda`` (that device's generator)."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda" and cuda.is_initialized():
        states["cuda"] = cuda.get_rng_state(device)
    return states


def set_rng_states(states: Mapping[str, torch.Tensor], device: torch.device, *,
                   cuda: CudaRng = torch.cuda) -> list[str]:
    """Put back what ``rng_states`` returned (on this process, or saved by the rank of the same
    number). Returns the states it had no generator for: a CUDA state on a CPU owner (a run
    saved on GPUs resumed on CPUs), which is ignored."""
    ignored = []
    for name, state in states.items():
        if name == "torch":
            torch.set_rng_state(state)
        elif name == "cuda" and device.type == "cuda":
            cuda.set_rng_state(state, device)
        else:
            ignored.append(name)
    return ignored


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that ``state_dict()`` contains (parameters excluded)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in params}


@dataclass(frozen=True)
class _Kept:
    rng: dict[str, torch.Tensor]
    buffers: list[torch.Tensor]  # per group of buffers of one dtype and device, their values end to end


class StepGuard:
    """Keeps the RNG states and the persistent buffers at the start of a step."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self._device = device
        # Found once (walking state_dict() every step costs milliseconds on a deep model): a
        # forward updates buffers in place (BatchNorm does); one that assigns a new tensor to a
        # buffer attribute is not put back. Aliased buffers once; meta ones hold no values.
        unique = {id(b): b for b in persistent_buffers(module).values() if b.device.type != "meta"}
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in unique.values():
            groups.setdefault((b.dtype, b.device), []).append(b)
        self._groups = list(groups.values())

    def keep(self) -> _Kept:
        # One copy per group, every step (a model with many BatchNorm layers has hundreds of small
        # buffers); putting them back happens only for a step not taken.
        with torch.no_grad():
            copies = [torch.cat([b.detach().reshape(-1) for b in group]) for group in self._groups]
        return _Kept(rng=rng_states(self._device), buffers=copies)

    def restore(self, kept: _Kept) -> None:
        with torch.no_grad():
            for group, flat in zip(self._groups, kept.buffers):
                for buf, value in zip(group, flat.split([b.numel() for b in group])):
                    buf.copy_(value.view_as(buf))
        set_rng_states(kept.rng, self._device)
