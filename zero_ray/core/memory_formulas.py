"""Model-state memory and communication accounting for ZeRO stages 0-3.

This module is the paper's arithmetic (Rajbhandari et al., sections 3.1, 5 and 7) and nothing
else: it imports neither ray nor grpc nor torch, so the CLI, the planner and the tests can use it
anywhere.

Accounting (the paper's, for mixed-precision Adam): every parameter costs `param_bytes` for the
working copy, `grad_bytes` for its gradient and `K = optimizer_bytes` for optimizer state. A stage
either replicates a category on every device or partitions it so that each of the `world_size`
devices holds one shard of `ceil(num_params / world_size)` elements, which is what a padded flat
buffer holds. Activations, temporary buffers and fragmentation (ZeRO-R) are not model states and
are not counted here.

Model parallelism (the paper's section 5 and Table 2): with N_m model-parallel (tensor-parallel)
ranks each holding 1/N_m of the parameters, ZeRO partitions that slice across the N_d data-parallel
ranks holding it, so `model_parallel=N_m` counts `ceil(num_params / N_m)` parameters over
`world_size = N_d`: model state shrinks by N_d x N_m at stage 3. The slice is the paper's even
1/N_m; a real plan that replicates norms and biases on every rank holds slightly more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from zero_ray.core.stages import STAGES as _PLANS
from zero_ray.core.stages import Residency
from zero_ray.errors import ConfigError

__all__ = [
    "OPTIMIZERS",
    "STAGES",
    "OptimizerState",
    "ParallelLayout",
    "StageSpec",
    "StateBytes",
    "TopologyComm",
    "communication_elements",
    "communication_volume_multiple",
    "factored_state_bytes",
    "largest_trainable_params",
    "model_state_bytes",
    "optimizer_bytes_per_param",
    "optimizer_state",
    "stage_spec",
    "topology_communication",
    "topology_state_bytes",
]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What one ZeRO stage partitions, and how much it communicates.

    `communication_multiple` is the per-step volume in units of Ψ before the ring factor
    (N - 1) / N: 2 for all-reduce (or reduce-scatter + all-gather), 3 when parameters must also be
    all-gathered a second time for the backward pass.
    """

    stage: int
    name: str
    partitions_params: bool
    partitions_grads: bool
    partitions_optimizer: bool
    communication_multiple: int

    @property
    def partitioned(self) -> tuple[str, ...]:
        """Names of the partitioned categories, in the order params, grads, optimizer."""
        flags = (("params", self.partitions_params), ("grads", self.partitions_grads),
                 ("optimizer", self.partitions_optimizer))
        return tuple(name for name, on in flags if on)


# Derived from the one description of the stages (core/stages.py), never restated here.
STAGES: Mapping[int, StageSpec] = MappingProxyType({
    n: StageSpec(stage=n, name=plan.name, partitions_params=plan.parameters is Residency.SHARDED,
                 partitions_grads=plan.gradients is Residency.SHARDED,
                 partitions_optimizer=plan.optimizer is Residency.SHARDED,
                 communication_multiple=plan.communication_multiple)
    for n, plan in _PLANS.items()
})

@dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """What a ``torch.optim`` optimizer keeps for each parameter, read from torch 2.13's sources.

    states: its per-element state tensors (torch's ``state`` keys), each the size and dtype of
        the parameter it updates (fp32: the master weights); scalars (``step``, NAdam's
        ``mu_product``, ASGD's ``eta``/``mu``) are left out.
    momentum_state: the one of ``states`` that ``momentum=False`` removes (SGD's buffer only:
        torch allocates it only when momentum is not 0).
    factored: Adafactor's second moment, which is not per element: a row and a column vector per
        matrix (``factored_state_bytes``), and a whole variance for a parameter of one dimension.
    note: what K leaves out, for reports.
    """

    torch_name: str
    states: tuple[str, ...]
    momentum_state: str | None = None
    factored: bool = False
    note: str = ""

    def per_element(self, *, momentum: bool = True) -> tuple[str, ...]:
        """The per-element states held (``momentum=False`` drops ``momentum_state``)."""
        return tuple(s for s in self.states if momentum or s != self.momentum_state)


_ADAM = ("exp_avg", "exp_avg_sq")
_AMSGRAD = (*_ADAM, "max_exp_avg_sq")

# Accepted names, lower case. A variant that holds more state than the optimizer's torch
# defaults is its own name (RMSprop's ``centered=True``/``momentum>0``, Adam's ``amsgrad=True``),
# so one name says what is counted. Adam and AdamW hold the same state (weight decay is
# stateless); Adam keeps both moments whatever beta1 is (torch allocates exp_avg with beta1 = 0).
OPTIMIZERS: Mapping[str, OptimizerState] = MappingProxyType({
    "sgd": OptimizerState(torch_name="SGD", states=("momentum_buffer",), momentum_state="momentum_buffer"),
    "adam": OptimizerState(torch_name="Adam", states=_ADAM),
    "adamw": OptimizerState(torch_name="AdamW", states=_ADAM),
    "adam-amsgrad": OptimizerState(torch_name="Adam(amsgrad=True)", states=_AMSGRAD),
    "adamw-amsgrad": OptimizerState(torch_name="AdamW(amsgrad=True)", states=_AMSGRAD),
    "adamax": OptimizerState(torch_name="Adamax", states=("exp_avg", "exp_inf")),
    "nadam": OptimizerState(torch_name="NAdam", states=_ADAM),
    "radam": OptimizerState(torch_name="RAdam", states=_ADAM),
    "adagrad": OptimizerState(torch_name="Adagrad", states=("sum",)),
    "adadelta": OptimizerState(torch_name="Adadelta", states=("square_avg", "acc_delta")),
    "rmsprop": OptimizerState(torch_name="RMSprop", states=("square_avg",)),
    "rmsprop-centered": OptimizerState(torch_name="RMSprop(centered=True)", states=("square_avg", "grad_avg")),
    "rmsprop-momentum": OptimizerState(torch_name="RMSprop(momentum>0)", states=("square_avg", "momentum_buffer")),
    "rmsprop-centered-momentum": OptimizerState(torch_name="RMSprop(centered=True, momentum>0)",
                                                states=("square_avg", "momentum_buffer", "grad_avg")),
    "asgd": OptimizerState(torch_name="ASGD", states=("ax",)),
    "rprop": OptimizerState(torch_name="Rprop", states=("prev", "step_size")),
    "muon": OptimizerState(torch_name="Muon", states=("momentum_buffer",),
                           note="Muon updates 2-D parameters only: the rest (biases, norms; usually the "
                                "embeddings and head too) need another optimizer, whose state is not counted"),
    "adafactor": OptimizerState(torch_name="Adafactor", states=(), factored=True,
                                note="Not in K: the factored second moment, 4 (R + C) B per R x C matrix "
                                     "(8/d B per element of a d x d one: 0.002 at d = 4096) and 4 B per element "
                                     "of 1-D parameters (biases, norms); factored_state_bytes(shapes) in "
                                     "zero_ray.core.memory_formulas counts it"),
})

#: fp32 bytes of one element of optimizer state, and of the master copy mixed precision keeps
_FP32 = 4


def optimizer_state(optimizer: str) -> OptimizerState:
    """The ``OptimizerState`` of ``optimizer`` (case-insensitive); anything else raises ``ConfigError``."""
    key = optimizer.strip().lower() if isinstance(optimizer, str) else None
    found = OPTIMIZERS.get(key) if key is not None else None
    if found is None:
        raise ConfigError(f"optimizer={optimizer!r} is not supported; accepted: {', '.join(sorted(OPTIMIZERS))}")
    return found


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Model-state bytes held by one device, by category: what the formulas predict, what a
    rank's memory report measures and what the benchmark counts for every system."""

    params: int
    grads: int
    optimizer: int
    secondary: int = 0  # hpZ's secondary partition of the parameters (stage 3 with a secondary group)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer", "secondary"):
            _check_int(f"StateBytes.{name}", getattr(self, name), minimum=0)

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state (+ hpZ's secondary copy), in bytes."""
        return self.params + self.grads + self.optimizer + self.secondary

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def _check_int(name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; `stage=True` is a caller bug, not stage 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}")
    return value


def stage_spec(stage: int) -> StageSpec:
    """The `StageSpec` of `stage`; raises `ConfigError` for anything but 0, 1, 2 or 3."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(f"{stage=} is outside 0..3 (the ZeRO stages are 0, 1, 2 and 3)")
    return STAGES[stage]


def optimizer_bytes_per_param(optimizer: str, *, mixed_precision: bool, momentum: bool = True) -> int:
    """K in the paper: optimizer-state bytes per parameter element.

    4 bytes per per-element state of ``OPTIMIZERS[optimizer]`` (all fp32), plus 4 for the fp32
    master copy in mixed precision (in fp32 the parameter is its own master copy, already in
    ``param_bytes``). So "adam"/"adamw": 12 mixed, 8 fp32; "sgd": 8 / 4 with momentum, 4 / 0
    without (``momentum`` only affects SGD); "adafactor": 4 / 0 per element, its factored
    second moment apart (``factored_state_bytes``). The name is case-insensitive; anything else
    raises ``ConfigError``.
    """
    state = optimizer_state(optimizer)
    return _FP32 * (len(state.per_element(momentum=momentum)) + (1 if mixed_precision else 0))


def factored_state_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """Adafactor's second moment for parameters of these shapes, in bytes (fp32), as
    ``torch.optim.Adafactor`` allocates it: a row vector and a column vector per matrix (for a
    parameter of shape ``(*batch, R, C)``: ``prod(batch) * (R + C)`` elements), and a whole
    variance for a parameter of one dimension (or none). Not per element, so not in K: for a
    d x d matrix it is 8/d bytes per element (0.002 at d = 4096), but 4 for biases and norms."""
    total = 0
    for shape in shapes:
        dims = [_check_int("shape entry", d, minimum=0) for d in shape]
        if len(dims) < 2:
            total += math.prod(dims)
        else:
            total += math.prod(dims[:-2]) * (dims[-2] + dims[-1])
    return _FP32 * total


def _mp_slice(count: int, model_parallel: int) -> int:
    """Elements of ``count`` one of ``model_parallel`` ranks holds: an even split, rounded up."""
    _check_int("model_parallel", model_parallel, minimum=1)
    return -(-count // model_parallel)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """``world_size`` owners as ``data_parallel`` (N_d) ranks of ``model_parallel`` (N_m) owners
    each, the paper's ZeRO-DP x MP (its 1T example: 1,024 = 64 x 16)."""

    data_parallel: int
    model_parallel: int = 1

    def __post_init__(self) -> None:
        _check_int("data_parallel", self.data_parallel, minimum=1)
        _check_int("model_parallel", self.model_parallel, minimum=1)

    @property
    def world_size(self) -> int:
        """Every owner: N_d x N_m."""
        return self.data_parallel * self.model_parallel

    @classmethod
    def of_world_size(cls, world_size: int, model_parallel: int) -> ParallelLayout:
        """The layout of ``world_size`` owners in groups of ``model_parallel``; a world size that
        is not a multiple of it raises ``ConfigError`` naming both."""
        _check_int("world_size", world_size, minimum=1)
        _check_int("model_parallel", model_parallel, minimum=1)
        if world_size % model_parallel:
            low = world_size // model_parallel * model_parallel
            near = " or ".join(str(n) for n in (low, low + model_parallel) if n)
            raise ConfigError(f"{world_size=} is not divisible by {model_parallel=}: the owners form data-parallel "
                              f"ranks of {model_parallel} model-parallel owners each; use a world size that is a "
                              f"multiple of {model_parallel} (e.g. {near})")
        return cls(data_parallel=world_size // model_parallel, model_parallel=model_parallel)


def _trainable(num_params: int, trainable_params: int | None) -> int:
    if trainable_params is None:
        return num_params
    _check_int("trainable_params", trainable_params, minimum=0)
    if trainable_params > num_params:
        raise ConfigError(f"{trainable_params=} exceeds {num_params=}")
    return trainable_params


def model_state_bytes(*, stage: int, num_params: int, world_size: int, param_bytes: int = 2,
                      grad_bytes: int = 2, optimizer_bytes: int = 12,
                      trainable_params: int | None = None, model_parallel: int = 1) -> StateBytes:
    """Model-state bytes on ONE of `world_size` data-parallel devices at ZeRO `stage`.

    A replicated category holds all its elements; a partitioned one holds `ceil(elements /
    world_size)` (the padded shard), so the result is the paper's formula exactly when the count
    is a multiple of `world_size` and slightly above it otherwise. The defaults are the paper's
    mixed-precision Adam (2 + 2 + 12 bytes per parameter). With `trainable_params` below
    `num_params` (frozen parameters, e.g. a LoRA fine-tune), every parameter costs
    `param_bytes` and only the trainable ones have gradients and optimizer state.

    With `model_parallel = N_m` > 1 the device is one of N_m model-parallel ranks and
    `world_size` is N_d, the data-parallel ranks holding its slice: it counts
    `ceil(num_params / N_m)` parameters (and `ceil(trainable_params / N_m)` trainable ones), the
    paper's (2 + 2 + K) Psi / (N_d N_m) at stage 3. N_m = 1 is the data-parallel formula.
    """
    spec = stage_spec(stage)
    _check_int("num_params", num_params, minimum=0)
    _check_int("world_size", world_size, minimum=1)
    _check_int("param_bytes", param_bytes, minimum=0)
    _check_int("grad_bytes", grad_bytes, minimum=0)
    _check_int("optimizer_bytes", optimizer_bytes, minimum=0)
    trainable = _mp_slice(_trainable(num_params, trainable_params), model_parallel)
    num_params = _mp_slice(num_params, model_parallel)

    def elements(count: int, partitioned: bool) -> int:
        return -(-count // world_size) if partitioned else count  # integer ceil: exact above 2**53

    return StateBytes(
        params=elements(num_params, spec.partitions_params) * param_bytes,
        grads=elements(trainable, spec.partitions_grads) * grad_bytes,
        optimizer=elements(trainable, spec.partitions_optimizer) * optimizer_bytes,
    )


OFFLOAD_TIERS = ("cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class TierBytes:
    """One device's model state by where it lies (bytes): on the device, in host memory, on NVMe."""

    device: int
    host: int
    nvme: int


def tier_bytes(state: StateBytes, *, stage: int, optimizer: str | None = None,
               params: str | None = None) -> TierBytes:
    """Where ``state`` (one device's, at ``stage``) lies under ZeRO-Offload / ZeRO-Infinity:
    the optimizer state (K per element: fp32 master and moments) moved to ``optimizer``'s tier,
    and at stage 3 the parameter partition and the gradient partition to ``params``'s ("cpu":
    host memory, "nvme": local disk, None: the device), as ZeRO-Infinity moves them: a reduced
    gradient shard goes to that tier as it is produced. Without parameter offload the
    gradients stay on the device, each partition copied to the optimizer's tier for the update
    a group at a time. Parameters are offloaded only at stage 3, where a device holds its
    partition and gathers a unit at a time; below, every device needs every parameter."""
    for name, tier in (("optimizer", optimizer), ("params", params)):
        if tier is not None and tier not in OFFLOAD_TIERS:
            raise ConfigError(f"{name} offload {tier!r} is not one of {OFFLOAD_TIERS} (or None: on the device)")
    if params is not None and not stage_spec(stage).partitions_params:
        raise ConfigError(f"parameters are offloaded at stage 3 only (stage {stage} keeps every parameter on every "
                          "device)")
    where = {"device": state.secondary, "cpu": 0, "nvme": 0}
    where[optimizer or "device"] += state.optimizer
    where[params or "device"] += state.params + state.grads
    return TierBytes(device=where["device"], host=where["cpu"], nvme=where["nvme"])


def communication_volume_multiple(stage: int) -> int:
    """Per-step communication volume of `stage` in units of Ψ, before the ring factor: 2 or 3."""
    return stage_spec(stage).communication_multiple


def communication_elements(*, stage: int, num_params: int, world_size: int,
                           trainable_params: int | None = None, model_parallel: int = 1) -> float:
    """Elements each device sends per training step with ring collectives.

    Stages 0-2 move 2Ψ (reduce-scatter of gradients + all-gather of parameters, which is what an
    all-reduce is), stage 3 moves 3Ψ (parameters are all-gathered in forward and again in
    backward); a ring sends (N - 1) / N of that volume from each device, so one device sends 0.
    Frozen parameters are neither reduced nor updated: stages 0-2 move 2 Ψ_trainable; stage 3
    gathers every parameter twice and reduces the trainable ones (at most 2Ψ + Ψ_trainable: a
    frozen unit that backward never passes through is not gathered again).

    With `model_parallel = N_m` > 1 this is ZeRO-DP's traffic only, among the `world_size` = N_d
    ranks holding one model-parallel slice: 2 Psi / N_m or 3 Psi / N_m. Model parallelism's own
    traffic (Megatron's all-reduces of activations in every layer, in proportion to batch x
    sequence x hidden, not to Psi) is not counted: the paper gives no closed form for it.
    """
    multiple = communication_volume_multiple(stage)
    _check_int("num_params", num_params, minimum=0)
    _check_int("world_size", world_size, minimum=1)
    trainable = _mp_slice(_trainable(num_params, trainable_params), model_parallel)
    num_params = _mp_slice(num_params, model_parallel)
    volume = (multiple - 1) * num_params + trainable if stage_spec(stage).partitions_params else 2 * trainable
    return (world_size - 1) / world_size * volume


def largest_trainable_params(*, stage: int, world_size: int, device_bytes: float, param_bytes: int = 2,
                             grad_bytes: int = 2, optimizer_bytes: int = 12,
                             trainable_fraction: float = 1.0, model_parallel: int = 1) -> float:
    """The Ψ whose model states exactly fill `device_bytes` per device at `stage`.

    Uses the continuous formula (no shard padding), as the paper's Table 2 does: with 32 GB and
    64 devices it gives 2B, 7.6B, 14.4B and 128B for stages 0-3. Memory for activations and
    buffers is not subtracted; pass a smaller `device_bytes` to leave room for them. With
    `trainable_fraction` below 1, only that fraction of Ψ has gradients and optimizer state.
    With `model_parallel = N_m` (`world_size` = N_d) each device holds Ψ / N_m of it, so the
    result is N_m times larger: Table 2's rows, e.g. 2T at stage 3 with N_m = 16.
    """
    if isinstance(trainable_fraction, bool) or not isinstance(trainable_fraction, (int, float)) \
            or not 0 < trainable_fraction <= 1:
        raise ConfigError(f"{trainable_fraction=} must be a number in (0, 1]")
    spec = stage_spec(stage)
    _check_int("world_size", world_size, minimum=1)
    _check_int("model_parallel", model_parallel, minimum=1)
    _check_int("param_bytes", param_bytes, minimum=0)
    _check_int("grad_bytes", grad_bytes, minimum=0)
    _check_int("optimizer_bytes", optimizer_bytes, minimum=0)
    if isinstance(device_bytes, bool) or not isinstance(device_bytes, (int, float)) \
            or not math.isfinite(device_bytes) or device_bytes < 0:
        raise ConfigError(f"{device_bytes=} must be a finite number of bytes >= 0")

    def per_param(nbytes: int, partitioned: bool) -> float:
        return nbytes / world_size if partitioned else float(nbytes)

    bytes_per_param = (per_param(param_bytes, spec.partitions_params)
                       + trainable_fraction * per_param(grad_bytes, spec.partitions_grads)
                       + trainable_fraction * per_param(optimizer_bytes, spec.partitions_optimizer))
    if bytes_per_param == 0:
        raise ConfigError("param_bytes, grad_bytes and optimizer_bytes are all 0: "
                          "a parameter that costs nothing has no largest model")
    return device_bytes / bytes_per_param * model_parallel


def topology_state_bytes(*, stage: int, num_params: int, world_size: int, shard_group_size: int | None = None,
                         secondary_group_size: int | None = None, param_bytes: int = 2, grad_bytes: int = 2,
                         optimizer_bytes: int = 12, trainable_params: int | None = None) -> StateBytes:
    """Model-state bytes on one owner with shard groups (MiCS / HSDP) and hpZ: the paper's
    formula with N = the shard group's size (None: the world), plus, with a secondary group of
    S owners (stage 3), the secondary partition ``ceil(num_params / S) * param_bytes``."""
    _check_int("world_size", world_size, minimum=1)
    group = world_size if shard_group_size is None else _check_int("shard_group_size", shard_group_size, minimum=1)
    if world_size % group:
        raise ConfigError(f"{shard_group_size=} does not divide {world_size=}")
    base = model_state_bytes(stage=stage, num_params=num_params, world_size=group, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, trainable_params=trainable_params)
    if secondary_group_size is None:
        return base
    _check_int("secondary_group_size", secondary_group_size, minimum=1)
    if not stage_spec(stage).partitions_params:
        raise ConfigError(f"secondary_group_size={secondary_group_size} (hpZ) applies to stage 3, not {stage=}")
    if group % secondary_group_size:
        raise ConfigError(f"{secondary_group_size=} must divide the shard group's {group} owners")
    return StateBytes(params=base.params, grads=base.grads, optimizer=base.optimizer,
                      secondary=-(-num_params // secondary_group_size) * param_bytes)


#: bytes on the wire per element of each comm dtype of a Topology, quantization scales excluded
#: (blockwise int8 / int4 add 4 bytes per block: ``quant_block`` elements)
COMM_BYTES: Mapping[str, float] = MappingProxyType({"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5})


def _comm_bytes(name: str | None, default: float, block: int) -> float:
    if name is None or name == "fp32":
        return default
    try:
        element = COMM_BYTES[name]
    except KeyError as err:
        raise ConfigError(f"comm dtype {name!r} is not one of {sorted(COMM_BYTES)}") from err
    return element + (4 / block if name in ("int8", "int4") else 0.0)


@dataclass(frozen=True, kw_only=True)
class TopologyComm:
    """Bytes one owner sends per step (averaged over the owners), inside its node and across nodes."""

    inside: float
    cross: float

    @property
    def total(self) -> float:
        return self.inside + self.cross


def _ring(members: int, nodes: int, volume: float) -> TopologyComm:
    """A ring over ``members`` consecutive owners spanning ``nodes`` nodes (node-major): each sends
    (m-1)/m of ``volume``; one owner per node sends across (when it spans several), so on
    average ``nodes (m-1) / m**2`` of it crosses."""
    if members <= 1:
        return TopologyComm(inside=0.0, cross=0.0)
    sent = (members - 1) / members * volume
    cross = nodes / members * sent if nodes > 1 else 0.0
    return TopologyComm(inside=sent - cross, cross=cross)


def _add(*parts: TopologyComm) -> TopologyComm:
    return TopologyComm(inside=sum(p.inside for p in parts), cross=sum(p.cross for p in parts))


def topology_communication(*, stage: int, num_params: int, world_size: int, node_size: int,
                           shard_group_size: int | None = None, secondary_group_size: int | None = None,
                           param_bytes: int = 2, grad_bytes: int = 2, weight_comm: str | None = None,
                           grad_comm: str | None = None, quant_block: int = 256) -> TopologyComm:
    """Bytes an owner sends per step with ring collectives over node-major ranks (``node_size``
    owners per node), inside its node and across, under a Topology:

    - parameters (stage 3: gathered for forward at ``weight_comm``, and for backward within the
      secondary group, else the shard group, at ``param_bytes``; stages 1-2: gathered after the
      update within the shard group; stage 0: part of the all-reduce);
    - gradients: reduce-scattered within the shard group at ``grad_bytes``, then each shard
      all-reduced across the replicas at ``grad_comm``; with one group and a quantized
      ``grad_comm``, hierarchically: inside the inner group (the secondary group, else a node),
      then across, at ``grad_comm``.

    Frozen parameters are not modelled (every parameter trains).
    """
    spec = stage_spec(stage)
    _check_int("num_params", num_params, minimum=0)
    _check_int("world_size", world_size, minimum=1)
    _check_int("node_size", node_size, minimum=1)
    if world_size % node_size:
        raise ConfigError(f"{node_size=} does not divide {world_size=}")
    g = world_size if shard_group_size is None else shard_group_size
    if world_size % g:
        raise ConfigError(f"{shard_group_size=} does not divide {world_size=}")
    psi = float(num_params)

    def span(members: int) -> int:  # nodes a run of ``members`` consecutive owners covers
        return max(1, -(-members // node_size))

    w_bytes = _comm_bytes(weight_comm, param_bytes, quant_block)
    g_bytes = _comm_bytes(grad_comm, grad_bytes, quant_block)
    replicas = world_size // g
    parts: list[TopologyComm] = []
    if replicas > 1:
        parts.append(_ring(g, span(g), psi * grad_bytes))
        # one member per group, each group its own run: the replica ring crosses nodes as far as the groups do
        parts.append(_ring(replicas, replicas if g >= node_size else span(world_size), 2 * psi / g * g_bytes))
    elif grad_comm not in (None, "fp32") and world_size > 1:
        inner = secondary_group_size or node_size
        outer = world_size // inner
        parts.append(_ring(inner, span(inner), psi * grad_bytes))
        if outer > 1:
            # an all-to-all among owners at the same place of each inner group, on different nodes
            # when the inner group is a node (or more)
            crossing = inner >= node_size or span(world_size) > 1
            sent = (outer - 1) / outer * psi / inner * g_bytes
            parts.append(TopologyComm(inside=0.0 if crossing else sent, cross=sent if crossing else 0.0))
    else:
        parts.append(_ring(g, span(g), psi * grad_bytes))
    if spec.partitions_params:
        parts.append(_ring(g, span(g), psi * w_bytes))  # forward
        s = secondary_group_size
        parts.append(_ring(s, span(s), psi * param_bytes) if s else _ring(g, span(g), psi * param_bytes))
    else:  # the gather after the update (stages 1-2), or the all-reduce's second half (stage 0)
        parts.append(_ring(g, span(g), psi * (param_bytes if spec.partitions_optimizer else grad_bytes)))
    return _add(*parts)
