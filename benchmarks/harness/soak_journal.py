"""What the soak's training driver tells its supervisor (benchmarks/soak.py, soak_driver.py): one
JSON line per event, appended to a file the supervisor names and flushed per line, so that a
driver SIGKILLed mid-run (``driver_sigkill``) leaves every line it wrote whole, and the driver
that attaches after it reads where the soak stands from the same file.

Lines, each an object with one key: ``run`` (run id, driver pid), ``baseline`` (fault-free
seconds a step by size), ``t0`` (the soak's start, ``time.monotonic()``: one clock for every
process on this machine), ``step`` (a ``StepAt``), ``recovery`` (a ``Recovered``), ``fault``
(a fault's record, index and the size the run should be at; the last line of an index wins),
``committed`` (a checkpoint's path and step), ``kill`` (the driver asks its supervisor for its
SIGKILL), ``ready`` (a driver that will attach is connected to Ray and has the run id: its pid and
``time.monotonic()``; for one started ahead, ``--standby``, when it was handed the run),
``attached`` (a new driver took the run over), ``calibration`` (a fault-free chunk run with the
soak's clock stopped: goodput's reference, harness/goodput.Calibration), ``event`` (one of the trainer's events during the
soak: resizes with their seconds, recoveries, attaches; soak seconds and text), ``end`` (the soak's
last figures)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.harness.goodput import Calibration, StepAt


@dataclass(frozen=True, kw_only=True)
class Recovered:
    """A RecoveryReport's figures, as the fault attribution reads them."""

    failed_step: int
    detect_s: float
    abort_s: float
    restore_s: float
    replay_s: float
    replayed_steps: int
    summary: str

    @classmethod
    def of(cls, report: Any) -> Recovered:
        return cls(failed_step=report.failed_step, detect_s=report.detect_s, abort_s=report.abort_s,
                   restore_s=report.restore_s, replay_s=report.replay_s, replayed_steps=report.replayed_steps,
                   summary=report.summary())


@dataclass(frozen=True, kw_only=True)
class Attached:
    """A driver that attached to the run after its predecessor's SIGKILL: when (soak seconds, on
    attach's return), the position the owners reported, its pid."""

    t_s: float
    step: int
    pid: int


@dataclass(kw_only=True)
class JournalState:
    """Everything the journal says so far."""

    run_id: str = ""
    pids: list[int] = field(default_factory=list)
    baseline: dict[str, Any] = field(default_factory=dict)
    baseline_recoveries: int = 0
    t0: float | None = None
    steps: list[StepAt] = field(default_factory=list)
    recoveries: list[Recovered] = field(default_factory=list)
    faults: dict[int, dict[str, Any]] = field(default_factory=dict)
    size: int = 0  # the size the injector keeps the run at (a resize changes it)
    committed: list[tuple[str, int]] = field(default_factory=list)
    kills: list[int] = field(default_factory=list)  # driver pids that asked for their SIGKILL
    attached: list[Attached] = field(default_factory=list)
    ready: dict[int, float] = field(default_factory=dict)  # attaching driver's pid -> when it could begin to
    events: list[tuple[float, str]] = field(default_factory=list)  # soak seconds, the trainer's event text
    calibrations: list[Calibration] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def paused_s(self) -> float:
        """Seconds the soak's clock stood still: its valid calibrations'."""
        return sum(c.paused_s for c in self.calibrations if c.valid)

    def soak_s(self, at: float) -> float:
        """A ``time.monotonic()`` reading in soak seconds: since t0, less the calibrations begun before it."""
        assert self.t0 is not None, "soak seconds exist only once the soak has begun"
        paused = 0.0
        for c in self.calibrations:
            if c.valid and self.t0 + c.at_s + paused < at:
                paused += c.paused_s
        return at - self.t0 - paused

    def add(self, line: dict[str, Any]) -> None:
        (key, value), = line.items()
        if key == "run":
            self.run_id = value["run_id"]
            self.pids.append(value["pid"])
        elif key == "baseline":
            self.baseline, self.baseline_recoveries = value["sizes"], value["recoveries"]
        elif key == "t0":
            self.t0 = value
        elif key == "step":
            self.steps.append(StepAt(**value))
        elif key == "recovery":
            self.recoveries.append(Recovered(**value))
        elif key == "fault":
            self.faults[value["index"]] = value["record"]
            self.size = value["size"]
        elif key == "committed":
            self.committed.append((value[0], value[1]))
        elif key == "kill":
            self.kills.append(value)
        elif key == "ready":
            self.ready[value["pid"]] = value["at"]
        elif key == "attached":
            self.attached.append(Attached(**value))
        elif key == "event":
            self.events.append((value["t_s"], value["text"]))
        elif key == "calibration":
            self.calibrations.append(Calibration(**value))
        elif key == "end":
            self.end = value
        else:
            raise ValueError(f"unknown journal line {key!r}: the driver and the supervisor disagree on the format")


class Journal:
    """Appends lines (flushed each) and reads them back, whole lines only."""

    path: str
    _offset: int
    _partial: bytes

    def __init__(self, path: str) -> None:
        self.path, self._offset, self._partial = path, 0, b""

    def write(self, key: str, value: Any) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({key: value}) + "\n")

    def step(self, at: StepAt) -> None:
        self.write("step", asdict(at))

    def read_new(self) -> list[dict[str, Any]]:
        """The lines written since the last call (a line still being written waits for its end)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data, self._partial = self._partial + data, b""
        *whole, rest = data.split(b"\n")
        self._partial = rest
        return [json.loads(line) for line in whole if line.strip()]


def read(path: str) -> JournalState:
    state = JournalState()
    for line in Journal(path).read_new():
        state.add(line)
    return state
