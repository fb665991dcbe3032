"""Run the side-by-side benchmark: every selected system on every selected model, in turn.

Per model: one set of global batches; the single-process reference trained on them in a
one-CPU Ray task; then each system on fresh actors: setup, peak-RSS reset, warm-up steps, timed
steps (driver wall clock, loopback counters read around them), reports, final parameters
against the reference, shutdown. A system that cannot run is recorded as unavailable with its
reason and the run goes on.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

from benchmarks.harness.compile_gain import eager_twin
from benchmarks.harness.netdev import loopback_available, read_interface
from benchmarks.harness.ray_env import runtime_env
from benchmarks.harness.results import BenchResults, RunResult, WorkloadInfo
from benchmarks.harness.stats import summarise
from benchmarks.harness.systems import (
    COMPILED_SIDE_BY_SIDE,
    SYSTEMS,
    System,
    SystemContext,
    SystemUnavailable,
    make_system,
)
from benchmarks.harness.workloads import WORKLOADS, Workload, gpt_workload, mlp_workload
from zero_ray.core.batching import Batch
from zero_ray.core.memory_formulas import communication_elements
from zero_ray.core.optimizer_plan import AdamW
from zero_ray.errors import ConfigError, ResourceError

log = logging.getLogger(__name__)

# The optimizer variants (zero1-fused, ...) are for the A/B of --systems, and the compiled
# systems (single+compile, ...) for --systems compiled: their first steps compile for a minute or
# more on a CPU, which would double the default run. Neither is run by default.
DEFAULT_SYSTEMS: tuple[str, ...] = tuple(name for name in SYSTEMS if eager_twin(name) is None
                                         and ("-" not in name or not name.startswith("zero")))
#: names ``--systems`` expands to a list
SYSTEM_GROUPS: dict[str, tuple[str, ...]] = {"all": DEFAULT_SYSTEMS, "compiled": COMPILED_SIDE_BY_SIDE}
# Below these the summary is too thin to compare systems; allowed (tests run 2 steps) but noted.
MIN_STEPS, MIN_WARMUP = 10, 3


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to run.

    systems / models: names from ``SYSTEMS`` / ``WORKLOADS``, run in this order.
    world_size: ranks of every distributed system (the single process has one).
    steps / warmup: timed steps, and untimed ones before them.
    lr / weight_decay: AdamW's (betas and eps are torch's defaults).
    atol: largest max-abs deviation from the single-process parameters reported as a match.
    mlp_width / mlp_depth / mlp_batch / gpt_batch: workload sizes (per-rank batches).
    timeout_s: bound on every wait for the actors.
    """

    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    models: tuple[str, ...] = ("mlp", "gpt")
    world_size: int = 2
    steps: int = MIN_STEPS
    warmup: int = MIN_WARMUP
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 1e-2
    atol: float = 1e-4
    mlp_width: int = 1024
    mlp_depth: int = 8
    mlp_batch: int = 32
    gpt_batch: int = 8
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.systems:
            raise ConfigError("systems=() selects nothing; name at least one of " + ", ".join(SYSTEMS))
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ConfigError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        if len(set(self.systems)) != len(self.systems):
            raise ConfigError(f"systems={self.systems} names a system twice")
        if not self.models:
            raise ConfigError("models=() selects nothing; name at least one of " + ", ".join(WORKLOADS))
        unknown = [m for m in self.models if m not in WORKLOADS]
        if unknown:
            raise ConfigError(f"unknown models {unknown}; choose from {', '.join(WORKLOADS)}")
        for name, minimum in (("world_size", 1), ("steps", 1), ("warmup", 0), ("mlp_width", 1), ("mlp_depth", 1),
                              ("mlp_batch", 1), ("gpt_batch", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
        if not self.atol >= 0:
            raise ConfigError(f"atol={self.atol!r} must be >= 0")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be > 0")
        AdamW(lr=self.lr, weight_decay=self.weight_decay)  # raises ConfigError naming the value

    @property
    def optimizer(self) -> AdamW:
        return AdamW(lr=self.lr, weight_decay=self.weight_decay)

    def workloads(self) -> list[Workload]:
        builders: dict[str, Callable[[], Workload]] = {
            "mlp": lambda: mlp_workload(width=self.mlp_width, depth=self.mlp_depth, per_rank_batch=self.mlp_batch),
            "gpt": lambda: gpt_workload(per_rank_batch=self.gpt_batch),
        }
        return [builders[m]() for m in self.models]


# -- the machine --------------------------------------------------------------------------------------
def _cpuinfo() -> tuple[str, int | None]:
    """CPU model name and the number of physical cores, from /proc/cpuinfo."""
    model, cores = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            phys = "0"
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and model in ("", platform.processor(), platform.machine()):
                    model = value
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    cores.add((phys, value))
    except OSError:
        return model, None
    return model, len(cores) or None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): on a shared machine
    they say how much else ran beside the benchmark."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: CPU, cores, memory, load, library versions, date."""
    model, physical = _cpuinfo()
    mem = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical,
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": mem,
        "loadavg_start": loadavg(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "deepspeed": _version("deepspeed"),
        "matplotlib": _version("matplotlib"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# -- Ray -----------------------------------------------------------------------------------------------
def ensure_ray(world_size: int, *, log_to_driver: bool = False) -> bool:
    """Start a local Ray unless one is connected; returns whether this call started it.

    Logical CPUs: at least ``world_size`` so that every rank's ``num_cpus=1`` fits even where
    there are fewer cores (the report shows the cores, so oversubscription is visible). A
    cluster is joined only when ``RAY_ADDRESS`` names one; otherwise the Ray is a new local one
    even where a ``ray start`` cluster runs on the machine (``ray.init()`` would join that, and
    refuses ``num_cpus`` when it does). A Ray this call starts or joins ships the benchmarks to
    its workers (``ray_env``); one already connected must have been started with
    ``ray_env.runtime_env()`` or from the repository root, for its workers to import them.
    """
    env = runtime_env()
    if ray.is_initialized():
        started = False
    elif os.environ.get("RAY_ADDRESS", "local") != "local":
        ray.init(include_dashboard=False, log_to_driver=log_to_driver, runtime_env=env)
        started = True
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                 log_to_driver=log_to_driver, runtime_env=env)
        started = True
    have = ray.cluster_resources().get("CPU", 0.0)
    if have < world_size:
        raise ResourceError(f"world_size={world_size} needs {world_size} CPUs (num_cpus=1 per rank) but the Ray "
                            f"cluster has {have:g}; lower --world-size or start Ray with more logical CPUs")
    return started


def _reference_task(workload: Workload, optimizer: AdamW, batches: list[Batch], seed: int) -> dict[str, torch.Tensor]:
    from zero_ray.testing import single_process

    torch.set_num_threads(1)  # like every rank
    params, _ = single_process(workload.model_fn, workload.loss_fn, optimizer, batches, seed=seed)
    return params


def reference_params(workload: Workload, optimizer: AdamW, batches: list[Batch], *, seed: int,
                     timeout_s: float) -> dict[str, torch.Tensor]:
    """The single-process parameters after all the batches (``zero_ray.testing.single_process``),
    computed in a one-CPU task so the driver's thread count does not change its arithmetic."""
    task = ray.remote(num_cpus=1, max_calls=1)(_reference_task)
    return ray.get(task.remote(workload, optimizer, batches, seed), timeout=timeout_s)


def max_abs_deviation(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest element-wise |params - ref| over all parameters; ConfigError when names or
    shapes differ (a system renamed or reshaped something)."""
    if params.keys() != ref.keys():
        raise ConfigError(f"parameter names differ from the reference: missing {sorted(ref.keys() - params.keys())}, "
                          f"extra {sorted(params.keys() - ref.keys())}")
    worst = 0.0
    for name, expected in ref.items():
        got = params[name].detach().to(torch.float32).cpu()
        if tuple(got.shape) != tuple(expected.shape):
            raise ConfigError(f"parameter {name}: shape {tuple(got.shape)} != reference {tuple(expected.shape)}")
        worst = max(worst, float((got - expected).abs().max()) if got.numel() else 0.0)
    return worst


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe_error(err: BaseException, limit: int = 400) -> str:
    """One line for the table: the remote cause of a Ray task error, type and message."""
    cause = getattr(err, "cause", None) or err
    text = f"{type(cause).__name__}: {cause}".strip()
    if isinstance(cause, SystemUnavailable):
        text = cause.reason
    text = _ANSI.sub("", text)  # Ray colours the remote frame names
    first = text.splitlines()[0] if text else type(cause).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _lo_tx() -> int | None:
    try:
        return read_interface("lo").tx_bytes
    except (OSError, ConfigError):
        return None


# Long enough to average over Ray's and zero_ray's periodic heartbeats, short beside a run.
IDLE_WINDOW_S = 1.0


def _idle_rate(window_s: float = IDLE_WINDOW_S) -> float | None:
    """Loopback bytes per second while the system under test is idle: the background that
    the timed steps' count also contains (on a shared machine, other people's local traffic)."""
    start, t0 = _lo_tx(), time.perf_counter()
    time.sleep(window_s)
    end, t1 = _lo_tx(), time.perf_counter()
    return (end - start) / (t1 - t0) if start is not None and end is not None else None


# -- one system on one model ----------------------------------------------------------------------------
def run_system(system: System, *, workload: Workload, config: BenchConfig, batches: Sequence[Batch],
               reference: dict[str, torch.Tensor], num_params: int) -> RunResult:
    """Train ``workload`` with ``system`` and measure it; never raises for the system's own
    failures (they become an unavailable or failed result); always shuts the system down."""
    n = system.world_size(config.world_size)
    head = {"model": workload.name, "system": system.name, "label": system.label, "world_size": n}
    # The paper's ring volume for the stage the system's design matches, fp32 elements.
    paper = 0.0 if system.paper_stage is None else \
        4.0 * communication_elements(stage=system.paper_stage, num_params=num_params, world_size=n)
    done = 0
    try:
        system.check_available()
        try:
            ctx = SystemContext(workload=workload, optimizer=config.optimizer, world_size=n, seed=config.seed,
                                timeout_s=config.timeout_s)
            system.setup(ctx)
            system.reset_peaks()
            warm = []
            for batch in batches[: config.warmup]:
                start = time.perf_counter()
                system.step(batch)
                warm.append(time.perf_counter() - start)
                done += 1
            idle = _idle_rate()
            load_before = loadavg()
            wall, rank = [], []
            lo = [_lo_tx()]  # read between steps, outside the timed window
            for batch in batches[config.warmup:]:
                start = time.perf_counter()
                own = system.step(batch)
                wall.append(time.perf_counter() - start)
                lo.append(_lo_tx())
                done += 1
                if own is not None:
                    rank.append(own)
        except SystemUnavailable:
            raise
        except Exception as err:
            if system.availability_by_trial and done == 0:
                raise SystemUnavailable(system.name, f"failed before its first step: {describe_error(err)}") from err
            raise
        load_after = loadavg()
        report = system.report()
        dev = max_abs_deviation(system.final_params(), reference)
    except SystemUnavailable as err:
        log.info("%s on %s: unavailable: %s", system.name, workload.name, err.reason)
        return RunResult(**head, status="unavailable", reason=err.reason, paper_bytes_per_rank_step=paper)
    except Exception as err:
        log.warning("%s on %s failed after %d steps", system.name, workload.name, done, exc_info=True)
        return RunResult(**head, status="failed", reason=f"after {done} steps: {describe_error(err)}",
                         paper_bytes_per_rank_step=paper)
    finally:
        try:
            system.shutdown()
        except Exception:
            log.warning("%s did not shut down cleanly", system.name, exc_info=True)
    steps = len(wall)
    sent = [r.sent_bytes_per_step for r in report.ranks]
    readable = all(x is not None for x in lo)
    lo_deltas = [float(b - a) for a, b in zip(lo, lo[1:])] if readable else []  # type: ignore[operator]
    return RunResult(
        **head, status="ok",
        step_ms=summarise(wall).scaled(1e3),
        first_step_ms=1e3 * (warm or wall)[0],
        rank_step_ms=summarise(rank).scaled(1e3) if rank else None,
        peak_rss_bytes=tuple(r.memory.peak_rss_bytes for r in report.ranks),
        lifetime_peak_rss_bytes=tuple(r.memory.lifetime_peak_rss_bytes for r in report.ranks),
        rss_source=report.ranks[0].memory.source,
        state_bytes=tuple(r.state.as_dict() for r in report.ranks),
        state_in_step_bytes=tuple(r.state_in_step.as_dict() for r in report.ranks if r.state_in_step is not None),
        sent_bytes_per_rank_step=tuple(int(s) for s in sent) if all(s is not None for s in sent) else None,
        sent_source=report.sent_source,
        paper_bytes_per_rank_step=paper,
        lo_bytes_per_step=(lo[-1] - lo[0]) / steps if lo_deltas else None,
        lo_bytes_step_median=summarise(lo_deltas).median if lo_deltas else None,
        lo_idle_bytes_per_s=idle,
        max_abs_dev=dev,
        params_match=dev <= config.atol,
        loadavg_1m=(load_before[0], load_after[0]) if load_before and load_after else None,
    )


def _with_ddp_ratio(runs: list[RunResult]) -> list[RunResult]:
    ddp = next((r for r in runs if r.system == "ddp" and r.ok), None)
    if ddp is None or ddp.step_ms is None or ddp.step_ms.median <= 0:
        return runs
    return [replace(r, ratio_to_ddp=r.step_ms.median / ddp.step_ms.median) if r.ok and r.step_ms else r for r in runs]


def run_benchmark(config: BenchConfig, *, workloads: Sequence[Workload] | None = None,
                  progress: Callable[[str], None] | None = None) -> BenchResults:
    """Run ``config`` (on ``workloads`` instead of ``config.models`` when given) on the
    connected Ray, starting a local one if none is; returns the results."""
    say = progress or (lambda _msg: None)
    ensure_ray(config.world_size)
    machine = machine_info()
    machine["ray_cluster_cpus"] = ray.cluster_resources().get("CPU")
    chosen = list(workloads) if workloads is not None else config.workloads()
    notes: list[str] = []
    if config.steps < MIN_STEPS or config.warmup < MIN_WARMUP:
        notes.append(f"only {config.steps} timed step(s) after {config.warmup} warm-up step(s) "
                     f"(a comparison needs >= {MIN_STEPS} after >= {MIN_WARMUP})")
    if not loopback_available():
        notes.append("/proc/net/dev has no readable 'lo' interface: lo bytes/step not measured")
    infos, runs = [], []
    for workload in chosen:
        num_params = workload.num_params()
        infos.append(WorkloadInfo(name=workload.name, description=workload.description, num_params=num_params,
                                  global_batch=workload.global_batch(config.world_size)))
        batches = workload.batches(config.warmup + config.steps, world_size=config.world_size, seed=config.seed + 1)
        say(f"[{workload.name}] single-process reference ({num_params:,} parameters)")
        reference = reference_params(workload, config.optimizer, batches, seed=config.seed, timeout_s=config.timeout_s)
        model_runs = []
        for name in config.systems:
            say(f"[{workload.name}] {name} ...")
            result = run_system(make_system(name), workload=workload, config=config, batches=batches,
                                reference=reference, num_params=num_params)
            say(f"[{workload.name}] {name}: " + (f"{result.step_ms.median:.1f} ms/step" if result.ok and result.step_ms
                                                 else f"{result.status}: {result.reason}"))
            model_runs.append(result)
        runs += _with_ddp_ratio(model_runs)
    machine["loadavg_end"] = loadavg()
    settings = {"systems": list(config.systems), "models": [w.name for w in chosen], "world_size": config.world_size,
                "steps": config.steps, "warmup": config.warmup, "seed": config.seed, "atol": config.atol,
                "optimizer": {"name": "AdamW", "lr": config.lr, "betas": list(config.optimizer.betas),
                              "eps": config.optimizer.eps, "weight_decay": config.weight_decay},
                "num_cpus_per_rank": 1, "torch_threads_per_rank": 1, "backend": "gloo", "dtype": "float32"}
    return BenchResults(machine=machine, settings=settings, workloads=tuple(infos), runs=tuple(runs), notes=tuple(notes))
