"""The systems a benchmark compares, behind one interface.

Each system trains ``ctx.workload`` on its own fresh Ray actors (one CPU and one torch thread
per rank, gloo between ranks) and is shut down before the next one starts. The driver-side
classes here decide how many ranks there are and how a global batch reaches them; the rank-side
code of the PyTorch systems lives in ``benchmarks.harness.ranks``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import ray
import torch

from benchmarks.harness import probe
from benchmarks.harness.compile_gain import COMPILE_SUFFIX, compiled_name
from benchmarks.harness.probe import MemoryProbe, StateBytes
from benchmarks.harness.ranks import (
    DeepSpeedRecipe,
    FSDP2Recipe,
    RankContext,
    RankWorker,
    SingleRecipe,
    TorchZeroRecipe,
)
from benchmarks.harness.handwritten import HandWrittenAdamW, handwritten_adamw
from benchmarks.harness.workloads import Workload
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.core.optimizer_plan import AdamW
from zero_ray.errors import ConfigError, ZeroRayError


class SystemUnavailable(ZeroRayError):
    """A system cannot run here (not installed, or not supported on this backend/device)."""

    def __init__(self, system: str, reason: str) -> None:
        self.system = system
        self.reason = reason
        super().__init__(f"{system} is unavailable: {reason}")


@dataclass(frozen=True, kw_only=True)
class SystemContext:
    """What every system is given: the same model, data, optimizer and world size."""

    workload: Workload
    optimizer: AdamW
    world_size: int
    seed: int
    timeout_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size!r} must be an integer >= 1")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank's measurements after the timed steps."""

    memory: MemoryProbe
    state: StateBytes  # after a step
    sent_bytes_per_step: int | None  # as the system itself counts it; None where it does not
    state_in_step: StateBytes | None = None  # where a step holds the most (gradients all present)


@dataclass(frozen=True, kw_only=True)
class SystemReport:
    """All ranks' measurements, in rank order, and where the sent-bytes figure came from."""

    ranks: tuple[RankReport, ...]
    sent_source: str | None


class System(Protocol):
    """One system under test. The runner calls, in order: ``check_available``, ``setup``,
    ``reset_peaks``, ``step`` (warm-up and timed), ``report``, ``final_params``, and always
    ``shutdown``."""

    name: str  #: command-line key, e.g. "zero2"
    label: str  #: what the table shows
    #: the ZeRO stage whose communication this system's design matches (the paper's formula
    #: gives the expected bytes sent), or None for a system that communicates nothing
    paper_stage: int | None
    #: errors before the first step completes mean "cannot run here" rather than "broke"
    availability_by_trial: bool

    def world_size(self, requested: int) -> int: ...

    def check_available(self) -> None:
        """Cheap checks in the driver; raises SystemUnavailable."""
        ...

    def setup(self, ctx: SystemContext) -> None: ...

    def reset_peaks(self) -> None:
        """Start every rank's peak-RSS reading afresh and arm its in-step model-state count
        (after setup)."""
        ...

    def step(self, batch: Batch) -> float | None:
        """One optimizer step on the global batch; returns the slowest rank's own step time
        in seconds where the system reports one."""
        ...

    def report(self) -> SystemReport: ...

    def final_params(self) -> dict[str, torch.Tensor]: ...

    def shutdown(self) -> None: ...


def _get(refs: Any, timeout_s: float) -> Any:
    return ray.get(refs, timeout=timeout_s)


# -- systems on the benchmark's own RankWorker actors -----------------------------------------------
class _RankedSystem:
    """Base of the systems whose ranks are ``RankWorker`` actors running a recipe."""

    recipe: ClassVar[type]
    name: str = ""
    label: str = ""
    paper_stage: int | None = 0
    availability_by_trial: bool = False
    #: the workload's blocks torch.compile'd by hand in every rank (``Workload.compiled_by_hand``)
    compiled: bool = False

    def __init__(self) -> None:
        self._workers: list[Any] = []
        self._timeout_s = 300.0

    def world_size(self, requested: int) -> int:
        return requested

    def check_available(self) -> None:
        pass

    def options(self) -> dict[str, Any]:
        return {}

    def setup(self, ctx: SystemContext) -> None:
        self._timeout_s = ctx.timeout_s
        n = self.world_size(ctx.world_size)
        cls = ray.remote(num_cpus=1, max_restarts=0)(RankWorker)
        self._workers = [cls.remote(rank=r, world_size=n, threads=1) for r in range(n)]
        master = _get(self._workers[0].rendezvous.remote(), ctx.timeout_s) if self.recipe.needs_process_group else None
        workload = ctx.workload.compiled_by_hand() if self.compiled else ctx.workload
        refs = []
        for r, w in enumerate(self._workers):
            rank_ctx = RankContext(workload=workload, optimizer=ctx.optimizer, seed=ctx.seed, rank=r,
                                   world_size=n, options=self.options())
            refs.append(w.setup.remote(self.recipe, rank_ctx, master, ctx.timeout_s))
        _get(refs, ctx.timeout_s)  # all ranks together: the process group forms across them

    def reset_peaks(self) -> None:
        _get([w.reset_peaks.remote() for w in self._workers], self._timeout_s)

    def step(self, batch: Batch) -> float | None:
        n = batch_size(batch)
        pieces = split_batch(batch, split_sizes(n, len(self._workers)))
        out = _get([w.step.remote(p, n) for w, p in zip(self._workers, pieces)], self._timeout_s)
        return max(seconds for _, seconds in out)

    def report(self) -> SystemReport:
        out = _get([w.report.remote() for w in self._workers], self._timeout_s)
        return SystemReport(ranks=tuple(RankReport(memory=m, state=s, state_in_step=mid, sent_bytes_per_step=None)
                                        for m, s, mid in out), sent_source=None)

    def final_params(self) -> dict[str, torch.Tensor]:
        # Every rank takes part (FSDP2 and ZeRO-3 gather); rank 0 answers.
        return _get([w.full_params.remote() for w in self._workers], self._timeout_s)[0]

    def shutdown(self) -> None:
        if self._workers:
            try:
                ray.get([w.close.remote() for w in self._workers], timeout=10)
            except Exception:  # a rank stuck in a collective cannot close; it is killed next
                pass
        for w in self._workers:
            ray.kill(w, no_restart=True)
        self._workers = []


class SingleProcessSystem(_RankedSystem):
    """The whole global batch in one process with ``torch.optim.AdamW``."""

    recipe = SingleRecipe
    name = "single"
    label = "single process"
    paper_stage = None

    def __init__(self, *, compile: bool = False) -> None:
        super().__init__()
        self.compiled = compile
        self.name, self.label = compiled_name("single", "single process", compile)

    def world_size(self, requested: int) -> int:
        return 1


class TorchZeroSystem(_RankedSystem):
    """DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(torch.optim.AdamW)``."""

    recipe = TorchZeroRecipe
    name = "torch-zero"
    label = "torch ZeroRedundancyOptimizer"
    paper_stage = 1  # DDP all-reduce (2Ψ) and a broadcast of each updated shard (about Ψ more)


class FSDP2System(_RankedSystem):
    """``torch.distributed.fsdp.fully_shard`` on CPU over gloo."""

    recipe = FSDP2Recipe
    name = "fsdp2"
    label = "FSDP2 fully_shard"
    paper_stage = 3
    availability_by_trial = True  # FSDP2's CPU/gloo support is only known by trying it

    def check_available(self) -> None:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as err:
            raise SystemUnavailable(self.name, f"torch {torch.__version__} has no fully_shard: {err}") from err


class DeepSpeedSystem(_RankedSystem):
    """DeepSpeed ZeRO stage 1, 2 or 3 (CPU accelerator, fp32, gloo)."""

    recipe = DeepSpeedRecipe
    availability_by_trial = True  # the CPU accelerator's support for a stage is known by trying

    def __init__(self, *, stage: int) -> None:
        super().__init__()
        if stage not in (1, 2, 3):
            raise ConfigError(f"DeepSpeed ZeRO {stage=} must be 1, 2 or 3")
        self.stage = stage
        self.name = f"ds{stage}"
        self.label = f"DeepSpeed ZeRO-{stage}"
        self.paper_stage = stage

    def check_available(self) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise SystemUnavailable(self.name, "deepspeed is not installed "
                                               "(DS_BUILD_OPS=0 pip install 'zero-ray[bench-deepspeed]')")

    def options(self) -> dict[str, Any]:
        return {"stage": self.stage}


# -- systems on actors defined elsewhere -----------------------------------------------------------
def _probe_actors(actors: Sequence[Any], fn: Callable[..., Any], timeout_s: float) -> list[Any]:
    # __ray_call__ runs fn(actor_instance) in the actor's process: the probes need no method on
    # classes the benchmark does not own.
    return _get([a.__ray_call__.remote(fn) for a in actors], timeout_s)


class DDPSystem:
    """PyTorch DistributedDataParallel: ``zero_ray.testing.DDPRun`` (with ``compile``, each
    rank's blocks torch.compile'd by hand inside DDP)."""

    paper_stage: int | None = 0
    availability_by_trial = False

    def __init__(self, *, compile: bool = False) -> None:
        self.compiled = compile
        self.name, self.label = compiled_name("ddp", "PyTorch DDP", compile)
        self._run: Any = None
        self._timeout_s = 300.0

    def world_size(self, requested: int) -> int:
        return requested

    def check_available(self) -> None:
        pass

    def setup(self, ctx: SystemContext) -> None:
        from zero_ray.testing import DDPRun

        self._timeout_s = ctx.timeout_s
        workload = ctx.workload.compiled_by_hand() if self.compiled else ctx.workload
        self._run = DDPRun(workload.model_fn, workload.loss_fn, ctx.optimizer, world_size=ctx.world_size,
                           seed=ctx.seed, num_cpus=1.0, timeout_s=ctx.timeout_s)

    def reset_peaks(self) -> None:
        _probe_actors(self._run.workers, probe.call_reset_ddp_peaks, self._timeout_s)

    def step(self, batch: Batch) -> float | None:
        return float(self._run.step(batch)["step_seconds"])

    def report(self) -> SystemReport:
        memory = _probe_actors(self._run.workers, probe.call_memory_probe, self._timeout_s)
        states = _probe_actors(self._run.workers, probe.call_ddp_worker_state, self._timeout_s)
        in_step = _probe_actors(self._run.workers, probe.call_in_step_state, self._timeout_s)
        return SystemReport(ranks=tuple(RankReport(memory=m, state=s, state_in_step=mid, sent_bytes_per_step=None)
                                        for m, s, mid in zip(memory, states, in_step)), sent_source=None)

    def final_params(self) -> dict[str, torch.Tensor]:
        return self._run.state_dict()

    def shutdown(self) -> None:
        if self._run is not None:
            self._run.shutdown()
            self._run = None


#: zero_ray's optimizer variants for the A/B: the benchmark's AdamW as built (torch's default:
#: the single-tensor loop on CPU), with foreach or fused kernels, and the pre-torch.optim arithmetic
OPTIMIZER_VARIANTS = ("", "foreach", "fused", "hand")


class ZeroRaySystem:
    """zero_ray's ``ZeroTrainer`` at one stage (with one of the ``OPTIMIZER_VARIANTS``, or
    ``ZeroConfig(compile=True)``)."""

    availability_by_trial = False

    def __init__(self, *, stage: int, variant: str = "", compile: bool = False) -> None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_ray {stage=} must be 0, 1, 2 or 3")
        if variant not in OPTIMIZER_VARIANTS:
            raise ConfigError(f"optimizer variant {variant!r} is not one of {OPTIMIZER_VARIANTS}")
        self.stage = stage
        self.variant = variant
        self.compiled = compile
        self.name, self.label = compiled_name(f"zero{stage}" + (f"-{variant}" if variant else ""),
                                              f"zero_ray stage {stage}" + (f" ({variant} AdamW)" if variant else ""),
                                              compile)
        self.paper_stage: int | None = stage
        # Stage 3 is accepted by ZeroConfig before it is implemented; trying it is the test.
        self.availability_by_trial = stage == 3
        self._trainer: Any = None
        self._timeout_s = 300.0

    def world_size(self, requested: int) -> int:
        return requested

    def check_available(self) -> None:
        import zero_ray as zr

        try:
            zr.ZeroConfig(stage=self.stage)
        except ConfigError as err:
            raise SystemUnavailable(self.name, str(err)) from err

    def setup(self, ctx: SystemContext) -> None:
        import zero_ray as zr

        self._timeout_s = ctx.timeout_s
        cfg = zr.ZeroConfig(stage=self.stage, world_size=ctx.world_size, device="cpu", backend="gloo",
                            seed=ctx.seed, num_cpus_per_owner=1.0, init_timeout_s=ctx.timeout_s,
                            step_timeout_s=ctx.timeout_s, collective_timeout_s=ctx.timeout_s,
                            # The default regions: the repeated blocks at stages 0-2, the innermost
                            # units at stage 3 (the gpt workload's Blocks: tests/unit/test_bench_compiled.py)
                            compile=self.compiled)
        self._trainer = zr.ZeroTrainer(ctx.workload.model_fn, ctx.workload.loss_fn, optimizer=self._optimizer(ctx),
                                       config=replace(cfg, optimizer_kinds={HandWrittenAdamW: "elementwise"}))
        if self.stage == 3 and ctx.world_size > 1:
            self._check_parameters_partitioned()

    def _optimizer(self, ctx: SystemContext) -> Any:
        opt = ctx.optimizer
        if self.variant == "hand":
            return handwritten_adamw(opt.lr, opt.weight_decay)
        if self.variant:
            return replace(opt, **{self.variant: True})
        return opt

    def _check_parameters_partitioned(self) -> None:
        # A stage that claims to partition parameters must hold less than a whole replica of
        # them; otherwise the numbers would describe stage 2 under stage 3's name.
        held = self._trainer.memory_report()[0].get("params", 0)
        whole = self._trainer.num_params * 4  # fp32
        if held >= whole:
            raise SystemUnavailable(self.name, f"ZeroConfig(stage=3) trains but does not partition parameters yet: "
                                               f"rank 0 holds {held} parameter bytes of {whole} for the whole model")

    def reset_peaks(self) -> None:
        _probe_actors(self._trainer.actors, probe.call_reset_peak_rss, self._timeout_s)

    def step(self, batch: Batch) -> float | None:
        # The owners' own step time is a diagnostic that ZeroTrainer's metrics have not always
        # carried; the driver's wall clock (the runner's) is the figure compared.
        own = self._trainer.step(batch).get("owner_step_seconds")
        return float(own) if own is not None else None

    def report(self) -> SystemReport:
        memory = _probe_actors(self._trainer.actors, probe.call_memory_probe, self._timeout_s)
        states, in_step = [], []
        for r in self._trainer.memory_report():
            # memory_report() counts a step's peak (gradients held); between steps the gradients
            # are released to grads_between_steps. Shard padding is memory the rank holds, so it
            # counts with its category.
            mid = StateBytes(params=r.get("params", 0) + r.get("padding_params", 0),
                             grads=r.get("grads", 0) + r.get("padding_grads", 0),
                             optimizer=r.get("optimizer", 0) + r.get("padding_optimizer", 0))
            in_step.append(mid)
            states.append(replace(mid, grads=r.get("grads_between_steps", mid.grads)))
        sent = [int(c["total"]) for c in self._trainer.comm_report()]
        return SystemReport(ranks=tuple(RankReport(memory=m, state=s, state_in_step=mid, sent_bytes_per_step=b)
                                        for m, s, mid, b in zip(memory, states, in_step, sent)),
                            sent_source="ZeroTrainer.comm_report() (last step)")

    def final_params(self) -> dict[str, torch.Tensor]:
        return self._trainer.full_state_dict()

    def shutdown(self) -> None:
        if self._trainer is not None:
            self._trainer.shutdown()
            self._trainer = None


# -- the registry ------------------------------------------------------------------------------------
def _factory(cls: Callable[..., System], **kwargs: Any) -> Callable[[], System]:
    return lambda: cls(**kwargs)


#: command-line name -> a factory of a fresh System (one per workload run)
SYSTEMS: Mapping[str, Callable[[], System]] = MappingProxyType({
    "single": _factory(SingleProcessSystem),
    "single+compile": _factory(SingleProcessSystem, compile=True),
    "ddp": _factory(DDPSystem),
    "ddp+compile": _factory(DDPSystem, compile=True),
    "torch-zero": _factory(TorchZeroSystem),
    "fsdp2": _factory(FSDP2System),
    "ds1": _factory(DeepSpeedSystem, stage=1),
    "ds2": _factory(DeepSpeedSystem, stage=2),
    "ds3": _factory(DeepSpeedSystem, stage=3),
    "zero0": _factory(ZeroRaySystem, stage=0),
    "zero1": _factory(ZeroRaySystem, stage=1),
    "zero2": _factory(ZeroRaySystem, stage=2),
    "zero3": _factory(ZeroRaySystem, stage=3),
    **{f"zero{stage}-{variant}": _factory(ZeroRaySystem, stage=stage, variant=variant)
       for stage in (1, 2, 3) for variant in OPTIMIZER_VARIANTS if variant},
    **{f"zero{stage}{COMPILE_SUFFIX}": _factory(ZeroRaySystem, stage=stage, compile=True) for stage in (0, 1, 2, 3)},
})

#: eager and compiled side by side (``--systems compiled``): single-process torch, DDP and
#: zero_ray stages 1-3, each followed by its compiled twin
COMPILED_SIDE_BY_SIDE: tuple[str, ...] = tuple(
    name for base in ("single", "ddp", "zero1", "zero2", "zero3") for name in (base, base + COMPILE_SUFFIX))


def make_system(name: str) -> System:
    """A fresh system by command-line name."""
    try:
        return SYSTEMS[name]()
    except KeyError:
        raise ConfigError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}") from None
