"""Fault injection at named points of an owner's work: for the kill-point tests and the recovery
benchmark, which need a real process killed (SIGKILL) at a precise moment.

The driver forwards ``ZERO_RAY_FAULT`` from its own environment to its owners: a JSON list of
``{"point": ..., "rank": ..., "after": steps, "dir": ...}``. The owner of rank ``rank`` that
reaches ``point`` with at least ``after`` driver steps completed creates ``dir/fault-POINT``
(holding the time) and kills its own process with SIGKILL. The file makes each fault happen once
per run, whatever is replayed or restarted afterwards. Unset (always, outside those tests and
that benchmark), nothing happens.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

from zero_ray.errors import ConfigError

ENV = "ZERO_RAY_FAULT"
POINTS = ("backward", "resize_transfer", "restore_transfer", "peer_snapshot", "checkpoint_save")


@dataclass(frozen=True, kw_only=True)
class Fault:
    point: str
    rank: int
    after: int
    dir: str

    @property
    def marker(self) -> str:
        return _marker(self.dir, self.point)


def _marker(directory: str, point: str) -> str:
    """The file a fault at ``point`` creates when it happens (holding the time)."""
    return os.path.join(directory, f"fault-{point}")


class FaultPlan:
    """The faults planned for this run's owners."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    @classmethod
    def parse(cls, text: str | None) -> FaultPlan | None:
        if not text:
            return None
        try:
            faults = [Fault(point=f["point"], rank=int(f["rank"]), after=int(f.get("after", 0)), dir=f["dir"])
                      for f in json.loads(text)]
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"{ENV}={text!r} must be a JSON list of {{point, rank, after, dir}}") from err
        bad = [f.point for f in faults if f.point not in POINTS]
        if bad:
            raise ConfigError(f"{ENV} points {bad} are not among {POINTS}")
        return cls(faults)

    def reached(self, point: str, rank: int, completed_steps: int) -> None:
        """Kill this process with SIGKILL if a planned fault is due here, the first time."""
        for f in self.faults:
            if f.point != point or f.rank != rank or completed_steps < f.after:
                continue
            try:
                fd = os.open(f.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, repr(time.time()).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)


def plan(*faults: Fault) -> str:
    """The ``ZERO_RAY_FAULT`` value for ``faults``."""
    return json.dumps([vars(f) for f in faults])


def killed_at(directory: str, point: str) -> float | None:
    """When the planned kill at ``point`` happened (Unix time), or None if it has not."""
    try:
        with open(_marker(directory, point), encoding="ascii") as fh:
            return float(fh.read())
    except (OSError, ValueError):
        return None
