"""zero_ray: ZeRO (Rajbhandari et al.) stages 0-3 as a Ray service."""

from __future__ import annotations

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
from zero_ray.core.offload_options import Offload
from zero_ray.core.optimizer_plan import SGD, AdamW
from zero_ray.core.precision import LossScaleConfig
from zero_ray.core.relay_tree import RelayConfig
from zero_ray.core.reply_combine import CombinedStep
from zero_ray.core.lr_schedule import WarmupCosine
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.topology import Topology
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.driver.callbacks import Callback
from zero_ray.driver.lifecycle import RunState, TrainerState
from zero_ray.driver.trainer import ZeroTrainer
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
from zero_ray.submit import submit

__version__ = "0.1.0"

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
