"""ZeroConfig: how a ZeroTrainer runs (frozen, keyword-only, validated on construction)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from zero_ray.checkpoint.location import check_location
from zero_ray.core.offload_options import Offload
from zero_ray.core.optimizer_plan import declared_kinds
from zero_ray.core.precision import LossScaleConfig, dtype_name, parse_dtype
from zero_ray.core.relay_tree import RelayConfig
from zero_ray.core.tls_options import ControlTLS
from zero_ray.core.stages import stage_plan
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.core.topology import Topology
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
INIT_MODES = ("full", "low_memory")
ON_NONFINITE = ("raise", "skip")
_Options = TypeVar("_Options")


def _wrap_policy(value: object) -> WrapPolicy:
    """None, a WrapPolicy, a callable, or a tuple of module classes / class names."""
    if value is None:
        return WrapPolicy()
    if isinstance(value, WrapPolicy):
        return value
    if isinstance(value, (tuple, list)):
        names = []
        for c in value:
            if isinstance(c, type):
                names.append(f"{c.__module__}.{c.__qualname__}")
            elif isinstance(c, str) and c:
                names.append(c)
            else:
                raise ConfigError(f"wrap_policy entry {c!r} must be a module class or a class name")
        if not names:
            raise ConfigError("wrap_policy=() names no module class; pass None for the default policy")
        return WrapPolicy(classes=tuple(names))
    if callable(value):
        return WrapPolicy(fn=value)  # type: ignore[arg-type]
    raise ConfigError(f"wrap_policy={value!r} must be None, a WrapPolicy, module classes or a callable")


#: heartbeats per health_timeout_s when health_interval_s is not given
HEARTBEATS_PER_TIMEOUT = 4
#: the heartbeat intervals an owner's Health stream accepts (control/servicers.py), in seconds
HEALTH_INTERVAL_RANGE_S = (0.01, 60.0)

@dataclass(frozen=True, kw_only=True)
class Stage3Config:
    """Stage-3 options (stages 0-2 refuse anything but the defaults).

    wrap_policy: which modules are units (gathered together): None for every direct child of
        the root with at least 2**16 elements, looking through ModuleList/Sequential (each
        transformer block); a tuple of module classes or class names; a callable
        ``ModuleInfo -> bool``; or a ``WrapPolicy`` (e.g. ``WrapPolicy(min_numel=0)``). The
        root is always a unit and holds whatever no other unit claims.
    prefetch_depth: units whose all-gather is issued ahead of the one computing, in forward and
        backward order (0: none).
    persistence_threshold: parameters with fewer elements stay whole on every rank (never
        gathered; reported as persistent); 0 (default) partitions every parameter.
    max_live_units: gathered buffers shared by the non-root units, which bounds peak parameter
        memory; None: unit nesting + prefetch_depth + 1.
    init: "full" builds ``torch.manual_seed(seed); model_fn()`` on the host, one rank of a node
        at a time, and keeps the shard; "low_memory" never materialises more than one parameter
        beyond the shard (see docs/stage3.md for which initialisations it reproduces).
    """

    wrap_policy: Any = None
    prefetch_depth: int = 1
    persistence_threshold: int = 0
    max_live_units: int | None = None
    init: str = "full"

    def __post_init__(self) -> None:
        object.__setattr__(self, "wrap_policy", _wrap_policy(self.wrap_policy))
        for name in ("prefetch_depth", "persistence_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0")
        if self.max_live_units is not None and (isinstance(self.max_live_units, bool)
                                                or not isinstance(self.max_live_units, int)
                                                or self.max_live_units < 1):
            raise ConfigError(f"max_live_units={self.max_live_units!r} must be an integer >= 1 or None")
        if self.init not in INIT_MODES:
            raise ConfigError(f"init={self.init!r} is not one of {INIT_MODES}")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointing:
    """Activation checkpointing (ZeRO-R's P_a; P_a+cpu with ``offload``), at any stage.

    Each unit the wrap policy chooses (outermost ones; the root never) runs under torch's
    non-reentrant ``checkpoint``: its forward keeps only its inputs, and backward recomputes it
    (with the forward's RNG state, so dropout draws the same masks).

    offload: keep those inputs in host memory (pinned, copied asynchronously, on a GPU) until
        the unit's backward brings them back. On CPU owners they are in host memory already:
        nothing moves.
    partition: with tensor parallelism (T > 1), each TP rank keeps 1/T of every unit's input
        (replicated over the TP group) and all-gathers it just before the recomputation (the
        paper's P_a; with ``offload``, P_a+cpu). None (default): on when T > 1.
    wrap_policy: which modules; None for the run's ``Stage3Config.wrap_policy`` (at stages 0-2,
        the default policy: each transformer block). Same forms as that option.
    """

    offload: bool = False
    wrap_policy: Any = None
    partition: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise ConfigError(f"offload={self.offload!r} must be True or False")
        if self.partition is not None and not isinstance(self.partition, bool):
            raise ConfigError(f"partition={self.partition!r} must be True, False or None (on when tensor_parallel "
                              "size > 1)")
        if self.wrap_policy is not None:
            object.__setattr__(self, "wrap_policy", _wrap_policy(self.wrap_policy))


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Modes that capture CUDA graphs, which replay fixed addresses: a stage-3 unit's parameters
# live in a different pool buffer at each gather.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True, kw_only=True)
class Compile:
    """``torch.compile`` per unit (regional compilation), at any stage.

    Each chosen module (see ``wrap_policy``; the root never) has its ``forward`` compiled; identical blocks share one compiled graph (torch compiles a block's code once per
    input shape and reuses it for every instance). The unit's hooks stay outside the compiled
    region: at stage 3 its parameters are gathered before the compiled forward runs and freed
    after. Parameter names are untouched (no ``_orig_mod.``).

    mode / fullgraph / dynamic / backend: passed to ``torch.compile``. Modes that capture CUDA
        graphs are refused at stage 3 (use "max-autotune-no-cudagraphs").
    wrap_policy: which modules, at stages 0-2 (default: the model's repeated blocks, the
        module classes held at least twice in a ``ModuleList`` or ``Sequential``; same forms as
        ``Stage3Config.wrap_policy``). At stage 3 the stage-3 units are compiled, those with no
        unit inside them, so every gather and free stays outside a compiled region.
    cache_dir: inductor's cache directory (compiled kernels and FX graphs), set in every owner
        before it compiles; None keeps inductor's default, ``/tmp/torchinductor_<user>``, which
        the owners on a node already share, so a replacement owner reuses what the others compiled.
    """

    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    wrap_policy: Any = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of torch.compile's modes {COMPILE_MODES}")
        if not isinstance(self.fullgraph, bool):
            raise ConfigError(f"fullgraph={self.fullgraph!r} must be True or False")
        if self.dynamic not in (None, True, False):
            raise ConfigError(f"dynamic={self.dynamic!r} must be True, False or None")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend={self.backend!r} must be the name of a torch.compile backend, e.g. 'inductor'")
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir):
            raise ConfigError(f"cache_dir={self.cache_dir!r} must be a directory path or None")
        if self.wrap_policy is not None:
            object.__setattr__(self, "wrap_policy", _wrap_policy(self.wrap_policy))

    def options(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments."""
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}


def _switch(name: str, value: object, options: type[_Options], example: str) -> _Options | None:
    """An option that is off or on with settings: None/False off; True on with ``options()``'s
    defaults; or an ``options`` instance (``example`` says how to write one in the error)."""
    if value is None or value is False:
        return None
    if value is True:
        return options()
    if isinstance(value, options):
        return value
    raise ConfigError(f"{name}={value!r} must be True, False, None or {example}")


REDUNDANCY = ("none", "peer")


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Surviving lost owners and changing the pool's size.

    The run has a desired size: ``ZeroConfig.world_size``, or what the last ``resize`` asked
    for (a detached run's survives its driver: a driver attaching keeps it). It grows beyond it only by ``resize()``. After a loss it continues with the survivors
    plus as many replacements as the cluster has room for (the lost owners' slots are freed at
    once), up to the desired size, and grows back to it when room appears (``grow_back``);
    never beyond it, whatever ``max_world_size`` allows. By default the survivors go on alone
    until the replacements are up (``continue_on_survivors``).

    redundancy: "peer" keeps, in every owner's host memory, a copy of its own shard and of one
        peer's (on another node when there is one), refreshed every ``snapshot_every`` steps, so
        a lost owner's partition comes back with no storage round trip; "none" restores from the
        last committed checkpoint only (``CheckpointConfig.dir`` or the last save's root).
    snapshot_every: steps between peer snapshots; the steps since are replayed after a loss.
    min_world_size / max_world_size: the smallest size a loss may leave (fewer fails the run)
        and the largest ``resize`` may ask for (None: no bound).
    grow_back: after a loss, grow again to the desired size when the cluster has room (a
        replaced node), checking Ray's free resources at most every ``grow_check_s`` seconds.
    continue_on_survivors: with ``grow_back``, a loss is restored onto the survivors at once and
        the next step runs on them, while replacements start (seconds: a process, torch) and
        join at the first step boundary at which they answer. Each survivor holds 1/(N-1) of the
        state meanwhile: False restores straight onto replacements, waiting for their start
        (``min_world_size`` equal to the size also keeps the partitions from growing).
    max_replay_steps: global batches the driver keeps to replay after a restore.
    backoff_s: wait this long times (failures - 1) before acting on a failure.
    detached: the owners are detached, named Ray actors: they outlive the driver's process, and a
        new driver continues the run from their memory with ``ZeroTrainer.attach(run_id, ...)``.
    orphan_timeout_s: a detached run's owners end themselves when no driver has been in touch
        for this long.
    """

    redundancy: str = "none"
    snapshot_every: int = 1
    min_world_size: int = 1
    max_world_size: int | None = None
    grow_back: bool = True
    continue_on_survivors: bool = True
    grow_check_s: float = 5.0
    max_replay_steps: int = 100
    backoff_s: float = 0.0
    detached: bool = False
    orphan_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.redundancy not in REDUNDANCY:
            raise ConfigError(f"redundancy={self.redundancy!r} is not one of {REDUNDANCY}")
        for name in ("snapshot_every", "min_world_size", "max_replay_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if self.max_world_size is not None and self.max_world_size < self.min_world_size:
            raise ConfigError(f"max_world_size={self.max_world_size} is below min_world_size={self.min_world_size}")
        if not (self.backoff_s >= 0 and self.grow_check_s >= 0):
            raise ConfigError(f"backoff_s={self.backoff_s!r} and grow_check_s={self.grow_check_s!r} must be >= 0")
        for name in ("detached", "grow_back", "continue_on_survivors"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if not (self.orphan_timeout_s > 0 and math.isfinite(self.orphan_timeout_s)):
            raise ConfigError(f"orphan_timeout_s={self.orphan_timeout_s!r} must be a finite number of seconds > 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Sharded checkpoints (``ZeroTrainer.save_checkpoint``; format in docs/checkpoints.md).

    dir: the default checkpoint root (``zero-ray checkpoint now`` without a path, ``fit``'s
        ``checkpoint_every``), or None: a local or shared directory, a URL (``s3://bucket/prefix``,
        ``gs://...``, ``file://...``), or a path inside ``filesystem``. A path that looks like a
        mangled URL (``s3:/bucket``) is refused.
    filesystem: a ``pyarrow.fs.FileSystem`` or an fsspec filesystem that ``dir`` is a path in
        (as Ray Train's ``storage_filesystem``), or None. It is shipped to every owner.
    keep: committed checkpoints kept per root; older ones are removed after each commit.
    timeout_s: bound on each wait of a save or a load (a rank's write, a rank's read).
    """

    dir: str | os.PathLike[str] | None = None
    keep: int = 3
    timeout_s: float = 600.0
    filesystem: Any = field(default=None, repr=False)  # may hold credentials: never printed

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep={self.keep!r} must be an integer >= 1 (checkpoints kept per root)")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be a finite number of seconds > 0")
        if self.dir is not None and not isinstance(self.dir, (str, os.PathLike)):
            raise ConfigError(f"dir={self.dir!r} must be a path, a URL or None")
        if self.dir is not None:
            check_location(self.dir, self.filesystem)
        elif self.filesystem is not None:
            raise ConfigError("filesystem= is given without dir=: name the checkpoint root inside it")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Configuration of a ZeroTrainer.

    stage: 0 (plain data parallelism), 1 (optimizer state partitioned), 2 (+ gradients),
        3 (+ parameters).
    world_size: number of partition owners (Ray actors), one device each.
    device: "cpu", "cuda" or "auto" (CUDA when the cluster has world_size GPUs now, else the CPU, warned).
    backend: "gloo", "nccl" or "auto" (NCCL on CUDA, gloo on CPU).
    dtype: compute dtype, "float32" (default), "bfloat16" or "float16"; master weights and
        optimizer state are float32 whatever this is. float16 uses dynamic loss scaling.
    reduce_dtype: the dtype gradients are accumulated and reduced in (FSDP2's
        ``MixedPrecisionPolicy.reduce_dtype``): None (default) for ``dtype``, or e.g. "float32"
        to reduce bfloat16 gradients in fp32 (twice the gradient bytes sent and held).
    grad_accum_steps: micro-batches each rank's piece of the global batch is split into.
    max_grad_norm: clip the global gradient norm (across all partitions) to this, or None.
    seed: ``torch.manual_seed`` before ``model_fn()`` on every rank.
    bucket_bytes: size of the flat gradient/parameter buckets (constant-size fused buffers).
    optimizer_kinds: optimizer classes zero_ray does not know, declared ``{cls: "elementwise"}``
        (every state tensor shaped like its parameter, updated element by element: run over
        the partition) or ``{cls: "whole_tensor"}`` (each parameter stepped whole on one
        owner); classes or "module.Class" names.
    collective_timeout_s: every collective wait is bounded by this.
    step_timeout_s / init_timeout_s / capacity_timeout_s: bounds on the driver's waits for a step / for
        start-up / for nodes with room for every owner, an autoscaler's (0: fail at once; docs/elastic.md).
    num_cpus_per_owner: logical CPUs each owner asks Ray for (CPU device), also its torch
        thread count.
    placement_strategy: where owners go, with Ray placement-group strategy names: PACK and SPREAD
        are Ray's own scheduling (best effort), STRICT_PACK puts every owner on one node,
        STRICT_SPREAD each on a node of its own. Each owner asks Ray for its own slot, so a lost
        or removed owner's slot goes back to the cluster at once (core/placement.py).
    loss_scale: dynamic loss scaling settings (float16 only).
    on_nonfinite: what a step whose loss or reduced gradient is non-finite (NaN or inf) does:
        "raise" (default) takes no step on any rank (the model, optimizer, scheduler and RNG
        are as before it, the position does not advance) and raises ``NonFiniteError`` naming
        the step and the ranks; "skip" skips the update as fp16 overflow does and counts the
        step. With float16, non-finite gradients from a finite loss are overflow: the loss
        scaler backs off and skips whatever this says (docs/numerics.md).
    health_interval_s / health_timeout_s: owners send heartbeats every interval over gRPC; one
        silent for the timeout (a frozen process) or whose stream breaks (a dead one) is lost.
        The interval defaults to a quarter of the timeout (2.5 s of the default 10 s), at most
        60 s (the longest an owner accepts; at least 10 ms): a dead
        owner is found when its stream breaks, at once, and a frozen one after the timeout,
        whatever the interval, so beats need only come often enough that three late ones are
        not a loss; each costs the driver 0.2-0.5 ms of CPU (``benchmarks.control_scale``).
    max_failures: failures survived per run (re-form the group, or restore lost partitions and
        replay; see ``ElasticConfig``); one more fails the run.
    control_token_dir: where the control token file is written (default: a private temp dir).
    control_tls: TLS / mTLS for every control-plane connection (``ControlTLS``), or None.
    relays: the control tree a step travels at scale (``RelayConfig(fan_out=8, min_owners=32)``):
        a pool of at least ``min_owners`` owners sends each step to one relay per node (hosted by
        the node's lowest rank), relays above them up to ``fan_out`` children each, and the
        replies come back combined (docs/architecture.md); smaller pools call every owner.
    stage3: stage-3 options (units, prefetch, persistence, construction); see ``Stage3Config``.
    activation_checkpointing: recompute each unit's forward in backward instead of keeping its
        activations: True, or ``ActivationCheckpointing(offload=True)`` to also keep the units'
        inputs in host memory; see ``ActivationCheckpointing``.
    compile: ``torch.compile`` each unit's forward (regional compilation): True, or
        ``Compile(mode=..., fullgraph=..., ...)``; see ``Compile``. Return the plain module from
        ``model_fn``: a module ``torch.compile``'d there is refused.
    offload: where each owner keeps its optimizer state, and at stage 3 its parameter shards:
        ``Offload(optimizer="nvme", params="nvme", path=...)`` streams them from local disk; see
        ``Offload``.
    init_state_dict: start from these weights instead of ``model_fn()``'s (fine-tuning): a
        safetensors file (e.g. ``zero-ray checkpoint consolidate``'s output; read a slice at a
        time at stage 3) or a ``{name: tensor}`` dict (which travels to every rank whole).
    checkpoint: sharded-checkpoint options; see ``CheckpointConfig``.
    elastic: surviving lost owners, growing and shrinking; see ``ElasticConfig``.
    topology: multi-node layout: shard groups (MiCS / HSDP), hpZ's secondary partition and
        quantized collectives (qwZ / qgZ), learned from the nodes Ray placed the owners on; see
        ``Topology`` (default: flat ZeRO over every owner).
    tensor_parallel: ``TensorParallel(size=T, plan=...)``: world_size / T data-parallel ranks of T
        tensor-parallel owners (docs/tensor_parallel.md); default T = 1.
    """

    stage: int = 2
    world_size: int = 2
    device: str = "auto"
    backend: str = "auto"
    dtype: str = "float32"
    reduce_dtype: str | None = None
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    seed: int = 0
    bucket_bytes: int = 25 * 2**20
    optimizer_kinds: Mapping[Any, str] | tuple[tuple[str, str], ...] | None = None
    collective_timeout_s: float = 300.0
    step_timeout_s: float = 900.0
    init_timeout_s: float = 120.0
    capacity_timeout_s: float = 600.0
    num_cpus_per_owner: float = 1.0
    placement_strategy: str = "PACK"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    on_nonfinite: str = "raise"
    health_interval_s: float | None = None  # health_timeout_s / HEARTBEATS_PER_TIMEOUT
    health_timeout_s: float = 10.0
    max_failures: int = 3
    control_token_dir: str | None = None
    control_tls: ControlTLS | None = None
    relays: RelayConfig = field(default_factory=RelayConfig)
    stage3: Stage3Config = field(default_factory=Stage3Config)
    activation_checkpointing: ActivationCheckpointing | bool | None = None
    compile: Compile | bool | None = None
    offload: Offload = field(default_factory=Offload)
    init_state_dict: str | os.PathLike[str] | Mapping[str, Any] | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    topology: Topology = field(default_factory=Topology)
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)

    def __post_init__(self) -> None:
        stage_plan(self.stage)  # raises ConfigError naming the stage
        if not isinstance(self.stage3, Stage3Config):
            raise ConfigError(f"stage3={self.stage3!r} must be a Stage3Config")
        object.__setattr__(self, "activation_checkpointing", _switch(
            "activation_checkpointing", self.activation_checkpointing, ActivationCheckpointing,
            "an ActivationCheckpointing (e.g. ActivationCheckpointing(offload=True))"))
        object.__setattr__(self, "compile", _switch("compile", self.compile, Compile,
                                                    "a zr.Compile(mode=..., fullgraph=..., ...)"))
        if self.stage == 3 and self.compile is not None and self.compile.wrap_policy is not None:
            raise ConfigError("compile=Compile(wrap_policy=...) was given with stage=3, where the compiled regions are "
                              "the stage-3 units themselves (each gathered around its compiled forward): choose them "
                              "with Stage3Config(wrap_policy=...)")
        if self.stage == 3 and self.compile is not None and self.compile.mode in CUDA_GRAPH_MODES:
            raise ConfigError(f"compile=Compile(mode={self.compile.mode!r}) captures CUDA graphs, which replay fixed "
                              "addresses, but a stage-3 unit is gathered into a different buffer each time; use "
                              "mode='max-autotune-no-cudagraphs' (or 'default')")
        if not isinstance(self.offload, Offload):
            raise ConfigError(f"offload={self.offload!r} must be a zr.Offload(optimizer='nvme', path=...)")
        if self.offload.any_on_nvme and self.device == "cuda":
            raise ConfigError(f"{self.offload} is built for CPU owners (device='cpu'); with device='cuda' keep the "
                              "model state in memory (Offload())")
        if self.offload.params_on_nvme and self.stage != 3:
            raise ConfigError(f"Offload(params='nvme') was given with stage={self.stage}: parameters are sharded, and "
                              "so offloaded, at stage 3 only (below it every owner uses every parameter each step); "
                              "use stage=3, or Offload(optimizer='nvme') to offload the optimizer state")
        if self.stage != 3 and self.stage3 != Stage3Config():
            raise ConfigError(f"stage3 options were given with stage={self.stage}; they apply to stage 3 only")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size!r} must be an integer >= 1")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not one of {DEVICES}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError("backend='nccl' needs device='cuda'; use backend='gloo' on CPU")
        parse_dtype(self.dtype)
        if self.reduce_dtype is not None:
            parse_dtype(self.reduce_dtype)
        object.__setattr__(self, "optimizer_kinds", declared_kinds(self.optimizer_kinds))
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps={self.grad_accum_steps!r} must be an integer >= 1")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number or None")
        if not isinstance(self.relays, RelayConfig):
            raise ConfigError(f"relays={self.relays!r} must be a zr.RelayConfig(fan_out=..., min_owners=...)")
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise ConfigError(f"loss_scale={self.loss_scale!r} must be a zr.LossScaleConfig")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} is not one of {ON_NONFINITE}")
        if self.bucket_bytes < 1024:
            raise ConfigError(f"bucket_bytes={self.bucket_bytes} is too small; use at least 1024 (default 25 MiB)")
        if self.max_failures < 0:
            raise ConfigError(f"max_failures={self.max_failures!r} must be >= 0")
        if self.health_interval_s is None and isinstance(self.health_timeout_s, (int, float)):
            object.__setattr__(self, "health_interval_s", min(self.health_timeout_s / HEARTBEATS_PER_TIMEOUT,
                                                              HEALTH_INTERVAL_RANGE_S[1]))
        low, high = HEALTH_INTERVAL_RANGE_S
        if isinstance(self.health_interval_s, (int, float)) and not low <= self.health_interval_s <= high:
            raise ConfigError(f"health_interval_s={self.health_interval_s!r} is outside the [{low}, {high}] seconds an "
                              "owner's heartbeat stream accepts; give one in that range (a longer health_timeout_s "
                              "needs no longer interval: beats only need to come more often than the timeout)")
        if not self.health_interval_s < self.health_timeout_s:
            raise ConfigError(f"health_interval_s={self.health_interval_s!r} must be below "
                              f"health_timeout_s={self.health_timeout_s!r}")
        for name in ("collective_timeout_s", "step_timeout_s", "init_timeout_s", "health_interval_s",
                     "health_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value!r} must be a finite number of seconds > 0")
        if not (self.capacity_timeout_s >= 0 and math.isfinite(self.capacity_timeout_s)):
            raise ConfigError(f"capacity_timeout_s={self.capacity_timeout_s!r} must be a finite number of seconds >= 0")
        if not self.num_cpus_per_owner > 0:
            raise ConfigError(f"num_cpus_per_owner={self.num_cpus_per_owner!r} must be > 0")
        if self.placement_strategy not in PLACEMENTS:
            raise ConfigError(f"placement_strategy={self.placement_strategy!r} is not one of {PLACEMENTS}")
        source = self.init_state_dict
        if source is not None and not isinstance(source, (str, os.PathLike, Mapping)):
            raise ConfigError(f"init_state_dict={type(source).__name__} must be a safetensors path or a dict")
        if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
            raise ConfigError(f"init_state_dict={os.fspath(source)!r} is not a file")
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise ConfigError(f"checkpoint={self.checkpoint!r} must be a CheckpointConfig")
        if not isinstance(self.elastic, ElasticConfig):
            raise ConfigError(f"elastic={self.elastic!r} must be an ElasticConfig")
        if self.elastic.min_world_size > self.world_size:
            raise ConfigError(f"elastic.min_world_size={self.elastic.min_world_size} is above {self.world_size=}")
        if self.elastic.max_world_size is not None and self.elastic.max_world_size < self.world_size:
            raise ConfigError(f"elastic.max_world_size={self.elastic.max_world_size} is below {self.world_size=}")
        if not isinstance(self.topology, Topology):
            raise ConfigError(f"topology={self.topology!r} must be a zr.Topology")
        self.topology.check_stage(self.stage)
        if not self.topology.flat and self.elastic.redundancy == "peer":
            raise ConfigError("elastic.redundancy='peer' is not supported with a non-flat topology yet (peer "
                              "snapshots assume one shard per rank); use redundancy='none' with checkpoints")
        for name in ("shard_group_size", "secondary_group_size"):
            size = getattr(self.topology, name)
            if isinstance(size, int) and self.world_size % size:
                raise ConfigError(f"topology.{name}={size} does not divide world_size={self.world_size}")
        if not isinstance(self.tensor_parallel, TensorParallel):
            raise ConfigError(f"tensor_parallel={self.tensor_parallel!r} must be a zr.TensorParallel")
        self.tensor_parallel.check_world_size(self.world_size)


# -- the run's math, as checkpoints and detached runs record it ----------------------------------

# The ZeroConfig fields that change what a step computes (docs/checkpoints.md says why each is
# here and why every other field is not): recorded in every checkpoint, restored by a resume
# without a config, and compared field by field with a config that is passed.
TRAINING_FIELDS = ("dtype", "reduce_dtype", "grad_accum_steps", "max_grad_norm", "seed", "loss_scale",
                   "optimizer_kinds", "on_nonfinite", "topology")


def training_record(config: ZeroConfig) -> dict[str, Any]:
    """``config``'s TRAINING_FIELDS as JSON data, normalised so that settings with the same
    math compare equal ("bf16" is "bfloat16"; ``reduce_dtype=None`` is the compute dtype)."""
    dtype = dtype_name(parse_dtype(config.dtype))
    record = {"dtype": dtype,
              "reduce_dtype": dtype_name(parse_dtype(config.reduce_dtype)) if config.reduce_dtype else dtype,
              "grad_accum_steps": config.grad_accum_steps, "max_grad_norm": config.max_grad_norm,
              "seed": config.seed, "loss_scale": asdict(config.loss_scale),
              "optimizer_kinds": [list(pair) for pair in declared_kinds(config.optimizer_kinds)],
              "on_nonfinite": config.on_nonfinite,
              # quantized collectives (qwZ, qgZ) only: shard groups and hpZ in fp32 do not change the math
              "topology": config.topology.math_record()}
    return json.loads(json.dumps(record))  # exactly what a manifest reads back


def config_from_training(record: Mapping[str, Any], *, stage: int, world_size: int) -> ZeroConfig:
    """The ZeroConfig a resume without a config runs with: ``stage`` and ``world_size`` as
    saved, the recorded TRAINING_FIELDS, defaults for everything else (none of which changes
    the math). A field the record lacks (a format-2 checkpoint records only dtype and seed)
    keeps its default."""
    fields: dict[str, Any] = {name: record[name] for name in TRAINING_FIELDS if name in record}
    if "loss_scale" in fields:
        fields["loss_scale"] = LossScaleConfig(**fields["loss_scale"])
    if "optimizer_kinds" in fields:
        fields["optimizer_kinds"] = tuple((str(n), str(k)) for n, k in fields["optimizer_kinds"])
    if "topology" in fields:
        fields["topology"] = Topology.from_math_record(dict(fields["topology"]))
    try:
        return ZeroConfig(stage=stage, world_size=world_size, **fields)
    except TypeError as err:
        raise ConfigError(f"the recorded training configuration {dict(record)} is not one this zero_ray reads "
                          f"({err})") from err


def training_conflicts(saved: Mapping[str, Any], config: ZeroConfig) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, config's value)`` for every recorded field ``config`` sets
    otherwise. ``loss_scale`` matters only where both run in float16."""
    mine = training_record(config)
    out = []
    for name in TRAINING_FIELDS:
        if name not in saved:
            continue
        if name == "loss_scale" and not (saved.get("dtype") == mine["dtype"] == "float16"):
            continue
        if saved[name] != mine[name]:
            out.append((name, saved[name], mine[name]))
    return out


def check_overrides(override: Sequence[str]) -> tuple[str, ...]:
    """``override`` (TRAINING_FIELDS a resume may change) checked and as a tuple."""
    if isinstance(override, str):
        override = (override,)
    names = tuple(override)
    unknown = [n for n in names if n not in TRAINING_FIELDS]
    if unknown:
        raise ConfigError(f"override={names!r} names {unknown}, which are not settings a checkpoint records; "
                          f"the ones that change the math are {list(TRAINING_FIELDS)} (stage, world size and every "
                          "other field may change freely)")
    return names


def refuse_conflicts(saved: Mapping[str, Any], config: ZeroConfig, *, override: Sequence[str], source: str,
                     how: str) -> list[tuple[str, Any, Any]]:
    """Raise a ConfigError naming each field where ``config`` would change the math of the run
    ``source`` saved, with both values and ``how`` to accept it; the conflicts ``override``
    accepts are returned (to be logged)."""
    allowed = set(check_overrides(override))
    conflicts = training_conflicts(saved, config)
    refused = [c for c in conflicts if c[0] not in allowed]
    if refused:
        fields = ", ".join(f"{name}={theirs!r} in the checkpoint but {mine!r} in config" for name, theirs, mine in refused)
        names = tuple(name for name, _, _ in refused)
        raise ConfigError(f"{source} was saved with other settings that change the math: {fields}. Resume without "
                          f"config= to restore them all (stage and world size as saved), pass a config with the "
                          f"checkpoint's values (ZeroTrainer.saved_config(path) returns it: dataclasses.replace it), "
                          f"or accept the change with {how}(..., override={names!r})")
    return [c for c in conflicts if c[0] in allowed]
