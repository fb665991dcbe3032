"""The benchmark's results as data: what one system measured on one model, and the whole run.

Plain frozen dataclasses with ``to_dict``/``from_dict`` so that the JSON file can be rendered
again (``--render``) without rerunning anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from benchmarks.harness.stats import Summary
from zero_ray.errors import ConfigError

STATUSES = ("ok", "unavailable", "failed")
SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One system trained on one model.

    Times are in milliseconds; ``step_ms`` is the driver's wall clock per step (dispatch
    included, the same for every system), ``rank_step_ms`` the slowest rank's own step time.
    Per-rank tuples are in rank order. ``lo_bytes_per_step`` counts every byte on the loopback
    interface during the timed steps divided by the steps, all ranks and Ray's own traffic
    together; ``lo_bytes_step_median`` is the median of the per-step deltas, which a burst of
    someone else's local traffic during one step does not move; ``lo_idle_bytes_per_s`` is the
    loopback rate over a second with the system idle just before the timed steps (background:
    heartbeats, other processes).
    """

    model: str
    system: str
    label: str
    status: str
    reason: str | None = None
    world_size: int
    step_ms: Summary | None = None
    rank_step_ms: Summary | None = None
    ratio_to_ddp: float | None = None
    peak_rss_bytes: tuple[int, ...] = ()
    lifetime_peak_rss_bytes: tuple[int, ...] = ()
    rss_source: str | None = None
    state_bytes: tuple[dict[str, int], ...] = ()  # after a step
    state_in_step_bytes: tuple[dict[str, int], ...] = ()  # inside a step, gradients all present
    sent_bytes_per_rank_step: tuple[int, ...] | None = None
    sent_source: str | None = None
    paper_bytes_per_rank_step: float | None = None
    lo_bytes_per_step: float | None = None
    lo_bytes_step_median: float | None = None  # median of the per-step deltas: robust to bursts
    lo_idle_bytes_per_s: float | None = None  # loopback rate with the system idle, just before timing
    max_abs_dev: float | None = None
    params_match: bool | None = None
    #: the machine's 1-minute load average before and after the timed steps: on a shared machine
    #: it says which rows ran beside someone else's work (the systems run one after another)
    loadavg_1m: tuple[float, float] | None = None
    #: the driver's wall clock of the run's first step (warm-up, or the first timed step without
    #: one): where a compiled system compiles its blocks, so it carries the compilation's cost
    first_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ConfigError(f"status={self.status!r} is not one of {STATUSES}")
        if self.status != "ok" and not self.reason:
            raise ConfigError(f"{self.system} on {self.model}: status {self.status!r} needs a reason")
        if self.status == "ok" and self.step_ms is None:
            raise ConfigError(f"{self.system} on {self.model}: an ok run needs step_ms")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("step_ms", "rank_step_ms"):
            value = getattr(self, name)
            out[name] = asdict(value) if value is not None else None
        for name in ("state_bytes", "state_in_step_bytes"):
            out[name] = [dict(s) for s in getattr(self, name)]
        for name in ("peak_rss_bytes", "lifetime_peak_rss_bytes"):
            out[name] = list(getattr(self, name))
        for name in ("sent_bytes_per_rank_step", "loadavg_1m"):
            if getattr(self, name) is not None:
                out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        for name in ("step_ms", "rank_step_ms"):
            if kwargs.get(name) is not None:
                kwargs[name] = Summary(**kwargs[name])
        for name in ("peak_rss_bytes", "lifetime_peak_rss_bytes", "state_bytes", "state_in_step_bytes"):
            kwargs[name] = tuple(kwargs.get(name) or ())
        for name in ("sent_bytes_per_rank_step", "loadavg_1m"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class WorkloadInfo:
    """What a model is, for the report."""

    name: str
    description: str
    num_params: int
    global_batch: int


@dataclass(frozen=True, kw_only=True)
class BenchResults:
    """A whole benchmark run."""

    machine: dict[str, Any]
    settings: dict[str, Any]
    workloads: tuple[WorkloadInfo, ...]
    runs: tuple[RunResult, ...]
    notes: tuple[str, ...] = field(default=())

    def runs_for(self, model: str) -> list[RunResult]:
        return [r for r in self.runs if r.model == model]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "machine": dict(self.machine), "settings": dict(self.settings),
                "workloads": [asdict(w) for w in self.workloads], "runs": [r.to_dict() for r in self.runs],
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResults:
        if data.get("schema") != SCHEMA_VERSION:
            raise ConfigError(f"results schema {data.get('schema')!r} is not {SCHEMA_VERSION}; rerun the benchmark")
        return cls(machine=data["machine"], settings=data["settings"],
                   workloads=tuple(WorkloadInfo(**w) for w in data["workloads"]),
                   runs=tuple(RunResult.from_dict(r) for r in data["runs"]), notes=tuple(data.get("notes", ())))
