"""zero_ray: ZeRO (Rajbhandari et al.) stages 0-3 as a Ray service.

The public names are loaded on first use (PEP 562 ``__getattr__``): every owner actor imports
this package on its way to ``zero_ray.owner``, and importing the driver, trainer and data
sources eagerly cost each owner start ~0.4 s of work it never used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_ray.errors import (
    CheckpointError,
    CollectiveError,
    CollectiveTimeout,
    ConfigError,
    DataError,
    ModelError,
    NonFiniteError,
    OwnerError,
    OwnerLostError,
    ResizeInterrupted,
    ResourceError,
    StopRequested,
    ZeroRayError,
)
# eager, not lazy: the import system binds the submodule zero_ray.submit to this name whenever
# something imports it first, so only an eager binding keeps zr.submit the function (cheap:
# submit.py imports Ray only when a job is submitted)
from zero_ray.submit import submit

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ below loads these
    from zero_ray import data, memory
    from zero_ray.config import (
        ActivationCheckpointing,
        CheckpointConfig,
        Compile,
        ControlTLS,
        ElasticConfig,
        Stage3Config,
        ZeroConfig,
    )
    from zero_ray.core.lr_schedule import WarmupCosine
    from zero_ray.core.offload_options import Offload
    from zero_ray.core.optimizer_plan import SGD, AdamW
    from zero_ray.core.precision import LossScaleConfig
    from zero_ray.core.relay_tree import RelayConfig
    from zero_ray.core.reply_combine import CombinedStep
    from zero_ray.core.stage3_units import WrapPolicy
    from zero_ray.core.tensor_parallel_plan import TensorParallel
    from zero_ray.core.topology import Topology
    from zero_ray.driver.callbacks import Callback
    from zero_ray.driver.lifecycle import RunState, TrainerState
    from zero_ray.driver.trainer import ZeroTrainer

__version__ = "0.1.0"

# public name -> the module that defines it (a submodule is its own module)
_LAZY: dict[str, str] = {
    "data": "zero_ray.data",
    "memory": "zero_ray.memory",
    "ActivationCheckpointing": "zero_ray.config",
    "CheckpointConfig": "zero_ray.config",
    "Compile": "zero_ray.config",
    "ControlTLS": "zero_ray.config",
    "ElasticConfig": "zero_ray.config",
    "Stage3Config": "zero_ray.config",
    "ZeroConfig": "zero_ray.config",
    "WarmupCosine": "zero_ray.core.lr_schedule",
    "Offload": "zero_ray.core.offload_options",
    "SGD": "zero_ray.core.optimizer_plan",
    "AdamW": "zero_ray.core.optimizer_plan",
    "LossScaleConfig": "zero_ray.core.precision",
    "RelayConfig": "zero_ray.core.relay_tree",
    "CombinedStep": "zero_ray.core.reply_combine",
    "WrapPolicy": "zero_ray.core.stage3_units",
    "TensorParallel": "zero_ray.core.tensor_parallel_plan",
    "Topology": "zero_ray.core.topology",
    "Callback": "zero_ray.driver.callbacks",
    "RunState": "zero_ray.driver.lifecycle",
    "TrainerState": "zero_ray.driver.lifecycle",
    "ZeroTrainer": "zero_ray.driver.trainer",
}


def __getattr__(name: str) -> Any:
    """Load a public name on first use and keep it, so later lookups are plain attributes."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_ray' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if name in ("data", "memory") else getattr(loaded, name)  # the two submodules
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "SGD",
    "ActivationCheckpointing",
    "Callback",
    "CombinedStep",
    "RelayConfig",
    "RunState",
    "TrainerState",
    "AdamW",
    "CheckpointConfig",
    "Compile",
    "ControlTLS",
    "ElasticConfig",
    "LossScaleConfig",
    "Offload",
    "WarmupCosine",
    "Stage3Config",
    "TensorParallel",
    "Topology",
    "WrapPolicy",
    "ZeroConfig",
    "ZeroTrainer",
    "submit",
    "data",
    "memory",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "DataError",
    "ModelError",
    "NonFiniteError",
    "OwnerError",
    "OwnerLostError",
    "ResizeInterrupted",
    "ResourceError",
    "StopRequested",
    "ZeroRayError",
    "__version__",
]
