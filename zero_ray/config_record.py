"""The whole ``ZeroConfig`` as the JSON data a checkpoint records (``Manifest.config``), and back.

A resume without ``config=`` continues the run that was saved, not a variant of it: every field
comes back (offload, elastic, checkpoint, stage3, device, activation checkpointing, compile, ...),
not only those that change the math (``TRAINING_FIELDS``, which are still what a passed config is
compared with). Option objects are recorded with their class name and rebuilt only as one of the
classes in ``_OPTIONS``, so reading a checkpoint constructs nothing else.

Some values cannot be written as data:
- a callable (``WrapPolicy.fn``) or a filesystem object (``CheckpointConfig.filesystem``) is
  recorded as what it was; ``restore_config`` puts its default back and names it in
  ``RestoredConfig.unrecorded``, unless the resume supplies it (the filesystem it reads the
  checkpoint through), so a resume refuses to run without it rather than quietly run otherwise;
- ``init_state_dict`` is recorded as None: the checkpoint's weights replace it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from zero_ray.config import (
    ActivationCheckpointing,
    CheckpointConfig,
    Compile,
    ControlTLS,
    ElasticConfig,
    Stage3Config,
    ZeroConfig,
)
from zero_ray.core.offload_options import Offload
from zero_ray.core.precision import LossScaleConfig
from zero_ray.core.relay_tree import RelayConfig
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.topology import Topology
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.errors import ConfigError

_OPTIONS: dict[str, type] = {cls.__name__: cls for cls in (
    ZeroConfig, Stage3Config, ActivationCheckpointing, Compile, ElasticConfig, CheckpointConfig, ControlTLS, Offload,
    Topology, LossScaleConfig, WrapPolicy, RelayConfig, TensorParallel)}
_CLASS = "__class__"  # an option object: its class name beside its fields
_UNRECORDED = "__unrecorded__"  # a value that is not data: what it was, for the error
#: ZeroConfig fields recorded as None, and why (docs/checkpoints.md)
NOT_CARRIED = {"init_state_dict": "the checkpoint's weights replace it"}
#: the field a resume can supply from how it reads the checkpoint
FILESYSTEM_FIELD = "checkpoint.filesystem"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoredConfig:
    """A recorded config rebuilt: ``config``, with each field in ``unrecorded`` (dotted names,
    e.g. ``"stage3.wrap_policy.fn"``, with what it was) at its default."""

    config: ZeroConfig
    unrecorded: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return ", ".join(f"{name}={what}" for name, what in self.unrecorded)


def config_record(config: ZeroConfig, *, world_size: int | None = None) -> dict[str, Any]:
    """``config`` as JSON data: every field, option objects tagged with their class;
    ``world_size``: the run's size now, where a resize or a loss changed it."""
    record = _encode(config, "")
    if world_size is not None:
        record["world_size"] = world_size
    return record


def restore_config(record: Mapping[str, Any], *, supply: Mapping[str, Any] | None = None) -> RestoredConfig:
    """The config ``record`` holds. ``supply`` gives values for fields the record could not
    hold, by dotted name (only ``FILESYSTEM_FIELD`` is supplied by a resume); one neither
    recorded nor supplied is at its default and named in ``unrecorded``. A record this
    zero_ray cannot read is a ConfigError."""
    unrecorded: list[tuple[str, str]] = []
    kwargs = _decode_fields(dict(record), "", dict(supply or {}), unrecorded)
    try:
        config = ZeroConfig(**kwargs)
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"the checkpoint's recorded config cannot be rebuilt by this zero_ray ({err}); pass "
                          "config= to choose the settings") from err
    return RestoredConfig(config=config, unrecorded=tuple(unrecorded))


def _path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _encode(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and _OPTIONS.get(type(value).__name__) is type(value):
        out: dict[str, Any] = {_CLASS: type(value).__name__}
        for f in dataclasses.fields(value):
            if f.init:
                name = _path(path, f.name)
                out[f.name] = None if name in NOT_CARRIED else _encode(getattr(value, f.name), name)
        return out
    if isinstance(value, (tuple, list)):  # every sequence in a config is a tuple once validated
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    module = getattr(value, "__module__", None) or type(value).__module__
    what = getattr(value, "__qualname__", None) or type(value).__qualname__
    return {_UNRECORDED: f"<{module}.{what}>"}


_DEFAULT = object()  # a field left to its default


def _decode(data: Any, path: str, supply: dict[str, Any], unrecorded: list[tuple[str, str]]) -> Any:
    if isinstance(data, list):
        return tuple(_decode(v, f"{path}[{i}]", supply, unrecorded) for i, v in enumerate(data))
    if not isinstance(data, dict):
        return data
    if _UNRECORDED in data:
        if path in supply:
            return supply[path]
        unrecorded.append((path, str(data[_UNRECORDED])))
        return _DEFAULT
    cls = _OPTIONS.get(str(data.get(_CLASS)))
    if cls is None or cls is ZeroConfig:
        raise ConfigError(f"the checkpoint's recorded config has {path}={data!r}, which is not an option this "
                          "zero_ray reads; pass config= to choose the settings")
    try:
        return cls(**_decode_fields(data, path, supply, unrecorded))
    except (TypeError, ConfigError) as err:
        raise ConfigError(f"the checkpoint's recorded {path} cannot be rebuilt by this zero_ray ({err}); pass "
                          "config= to choose the settings") from err


def _decode_fields(data: dict[str, Any], path: str, supply: dict[str, Any],
                   unrecorded: list[tuple[str, str]]) -> dict[str, Any]:
    kwargs = {}
    for name, value in data.items():
        if name == _CLASS:
            continue
        decoded = _decode(value, _path(path, name), supply, unrecorded)
        if decoded is not _DEFAULT:
            kwargs[name] = decoded
    return kwargs
