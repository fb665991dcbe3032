"""Where a rank's model comes from: building and checking the module, describing it for the
planners, and the sources of initial parameter values (the module itself, recorded
initialisations, or a state dict / safetensors file read a slice at a time)."""

from __future__ import annotations

import math
import os
import socket
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from zero_ray.collective.collective_api import Collective
from zero_ray.core.stage3_units import ModuleInfo
from zero_ray.errors import CheckpointError, ModelError
from zero_ray.owner.construction.compiled import refuse_user_compile
from zero_ray.owner.construction.materialize import InitRecorder


def build_module(model_fn: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``torch.manual_seed(seed); model_fn()``, as the single-process reference builds it."""
    torch.manual_seed(seed)
    return check_module(model_fn())


def check_module(module: object) -> nn.Module:
    """``module`` if zero_ray can train it: a module with floating-point parameters, at least one
    of them trainable (``requires_grad=False`` ones are frozen: held, never updated)."""
    if not isinstance(module, nn.Module):
        raise ModelError(f"model_fn must return a torch.nn.Module; it returned {type(module).__name__}")
    refuse_user_compile(module)
    named = list(module.named_parameters())
    bad = [(n, p.dtype) for n, p in named if not p.dtype.is_floating_point]
    if bad:
        raise ModelError(f"parameters must be floating point to be trained; found {bad}")
    if not named:
        raise ModelError("model_fn returned a module without parameters")
    if not any(p.requires_grad for _, p in named):
        raise ModelError(f"every one of the module's {len(named)} parameters has requires_grad=False: there is "
                         "nothing to train; unfreeze some (e.g. a PEFT adapter) before returning the module")
    return module


def param_specs(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every distinct parameter, in registration order."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in module.named_parameters()]


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers (norm statistics, masks) take the compute dtype."""
    for buf in module.buffers():
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def describe_modules(module: nn.Module) -> tuple[list[ModuleInfo], list[list[str]], list[list[str]]]:
    """``module`` as the planner sees it: ModuleInfo per module, and per distinct parameter the
    module paths and the full names (aliases first-registered first) that register it."""
    named = list(module.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    sites: list[list[str]] = [[] for _ in named]
    names: list[list[str]] = [[] for _ in named]
    for full, p in module.named_parameters(remove_duplicate=False):
        sites[index[id(p)]].append(full.rpartition(".")[0])
        names[index[id(p)]].append(full)
    # Elements under each module path: every distinct parameter counted once per ancestor of
    # any of its registrations (linear in parameters x depth, not modules x parameters).
    numel: Counter[str] = Counter()
    for (_, p), where in zip(named, sites):
        ancestors = {""}
        for path in where:
            parts = path.split(".") if path else []
            ancestors.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
        for a in ancestors:
            numel[a] += p.numel()
    infos: list[ModuleInfo] = []
    for path, m in module.named_modules():
        own = tuple(dict.fromkeys(index[id(p)] for p in m.parameters(recurse=False)))
        classes = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(m).__mro__ if issubclass(c, nn.Module))
        infos.append(ModuleInfo(path=path, classes=classes, params=own, numel=numel[path]))
    return infos, sites, names


# -- where initial values come from -----------------------------------------------------------------
class ParamSource(Protocol):
    """Initial parameter values, one flattened range at a time (fp32, on the host)."""

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor: ...

    def buffer(self, name: str) -> torch.Tensor | None: ...


class ModuleSource:
    """The parameters of a module built whole on the host (init="full")."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        return self._params[index].detach().reshape(-1)[start:end].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        return None


class RecipeSource:
    """Recorded initialisations, materialised one parameter at a time (init="low_memory")."""

    def __init__(self, recorder: InitRecorder, params: Sequence[torch.Tensor]) -> None:
        self._recorder = recorder
        self._params = list(params)
        self._index = -1
        self._value: torch.Tensor | None = None

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        if index != self._index:
            self._value = None  # release the previous parameter before building the next
            self._value = self._recorder.recipe_for(self._params[index]).materialize().reshape(-1)
            self._index = index
        assert self._value is not None
        return self._value[start:end].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        return None


class StateDictSource:
    """A ``{name: tensor}`` dict or a safetensors file; a file is read a slice at a time."""

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, Any], *, names: Sequence[Sequence[str]],
                 shapes: Sequence[tuple[int, ...]]) -> None:
        self._dict: Mapping[str, Any] | None = None
        self._file: Any = None
        if isinstance(source, Mapping):
            self._dict = source
            keys = set(source)
        else:
            from safetensors import safe_open

            try:
                self._file = safe_open(os.fspath(source), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own types for bad headers
                raise CheckpointError(f"cannot read {os.fspath(source)!r} as safetensors: {err}") from err
            keys = set(self._file.keys())
        self._keys: list[str] = []
        missing: list[str] = []
        for aliases in names:
            found = next((n for n in aliases if n in keys), None)
            self._keys.append(found or "")
            if found is None:
                missing.append(aliases[0])
        if missing:
            raise CheckpointError(f"init_state_dict has no value for parameters {missing}")
        wrong = [(k, tuple(self._shape(k)), tuple(s)) for k, s in zip(self._keys, shapes) if tuple(self._shape(k)) != tuple(s)]
        if wrong:
            raise CheckpointError(f"init_state_dict shapes differ from the model's (name, file, model): {wrong}")
        self._buffer_keys = keys

    def _shape(self, key: str) -> tuple[int, ...]:
        if self._dict is not None:
            return tuple(self._dict[key].shape)
        return tuple(self._file.get_slice(key).get_shape())

    def fragment(self, index: int, start: int, end: int) -> torch.Tensor:
        key = self._keys[index]
        if self._dict is not None:
            return torch.as_tensor(self._dict[key]).detach().reshape(-1)[start:end].float()
        shape = self._shape(key)
        if len(shape) == 0:
            return self._file.get_tensor(key).reshape(-1)[start:end].float()
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)  # read only the rows that hold [start, end)
        rows = self._file.get_slice(key)[first:last]
        return rows.reshape(-1)[start - first * row:end - first * row].float()

    def buffer(self, name: str) -> torch.Tensor | None:
        if name not in self._buffer_keys:
            return None
        return torch.as_tensor(self._dict[name]) if self._dict is not None else self._file.get_tensor(name)


def node_turn(group: Collective, rank: int) -> tuple[int, int]:
    """This rank's turn among the ranks on its host, and the most ranks any host has: ranks
    build the full model one per host at a time, so a host never holds two full copies."""
    n = group.world_size
    values = [0.0] * n
    values[rank] = float(zlib.crc32(socket.gethostname().encode()))  # < 2**32: exact in float64
    hosts = group.all_reduce_values(values) if n > 1 else values
    turn = sum(1 for r in range(rank) if hosts[r] == hosts[rank])
    return turn, max(Counter(hosts).values())

