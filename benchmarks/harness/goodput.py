"""The soak's goodput, fair to a run whose size changes (benchmarks/soak.py, docs/elastic.md "Soak").

On 2 shared cores fewer owners step faster (less contention), so crediting every soak step with
the 4-owner fault-free time overstates a soak that spends its time at 3 (the first soak measured
102%). Instead each size the soak passes through has its own fault-free seconds a step, measured
on the same cluster, workload and batch right before the soak, and

    goodput = sum over sizes n of (steps taken at n x fault-free seconds a step at n) / soak wall time

i.e. the time a fault-free run at the same sizes would have needed for the same steps, over the
time the soak took. The fault-free seconds a step pool the baselines with the soak's calibrations:
fault-free chunks interleaved with the soak (``Calibration``), so the reference sees the same
stretches of the machine's load as the faults do. Pure: no Ray, no torch (tests/unit/test_soak_goodput.py)."""

from __future__ import annotations

from dataclasses import dataclass

DEFINITION = ("sum over world sizes n of (soak steps taken at n x fault-free seconds a step at n, measured on "
              "the same cluster and workload before the soak and in fault-free chunks interleaved with it) / "
              "soak wall seconds")


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A fault-free chunk the soak ran between its own chunks, with no fault in flight and its clock
    stopped (the soak does not count its steps or time): the fault-free pace at ``size`` in the
    soak's own stretch of the machine's load. A fault-free soak measured its steps 14-25% slower
    than the baselines taken before it (4 minutes, no fault: goodput 79.8%), so a reference taken
    only before the soak charges the load's drift to the faults. A round calibrates the run's size
    and, in turn, one other (a resize there and back inside the round). ``valid`` False: a recovery
    landed in its round, or the round did not end at the run's size (its time is then the soak's,
    and it is no reference)."""

    at_s: float  # soak seconds when its round began
    size: int
    steps: int
    s: float  # its CHUNK's seconds
    valid: bool
    # the soak clock's stop for its round (resizes to other sizes and back, warm-up, every chunk),
    # on the round's first calibration; 0 on the others
    paused_s: float = 0.0


def reference_step_s(baseline: dict[int, tuple[int, float]], calibrations: list[Calibration]) -> dict[int, float]:
    """Fault-free seconds a step at each size: the baseline's (``size -> (steps, seconds)``)
    pooled with every valid calibration's at that size (total seconds over total steps)."""
    steps = {n: b[0] for n, b in baseline.items()}
    secs = {n: b[1] for n, b in baseline.items()}
    for c in calibrations:
        if c.valid:
            steps[c.size] = steps.get(c.size, 0) + c.steps
            secs[c.size] = secs.get(c.size, 0.0) + c.s
    return {n: secs[n] / steps[n] for n in sorted(steps) if steps[n] > 0}


@dataclass(frozen=True, kw_only=True)
class StepAt:
    """One soak step done: seconds into the soak when it was reported, its step number, and the
    owners that took it."""

    t_s: float
    step: int
    size: int


@dataclass(frozen=True, kw_only=True)
class SizeShare:
    """What the soak did at one world size: steps, wall seconds spent there (each step's
    interval since the step before), the fault-free seconds a step there and what those steps
    are worth fault-free. ``measured`` False: no baseline at this size, so the fastest measured
    size's time is used (the smallest credit: goodput is never flattered by a missing size)."""

    size: int
    steps: int
    s: float
    fault_free_step_s: float
    fault_free_s: float
    measured: bool


def fault_free_step_s(size: int, baseline: dict[int, float]) -> tuple[float, bool]:
    """Seconds a step at ``size`` fault-free, and whether that size was measured (else the
    fastest measured size's)."""
    if not baseline:
        raise ValueError("no fault-free baseline at any size: measure at least one before the soak")
    if any(s <= 0 for s in baseline.values()):
        raise ValueError(f"fault-free seconds a step must be positive, got {baseline}")
    if size in baseline:
        return baseline[size], True
    return min(baseline.values()), False


def shares(steps: list[StepAt], *, end_s: float, baseline: dict[int, float]) -> list[SizeShare]:
    """Each size's steps and wall seconds over a soak of ``end_s`` seconds: the interval before
    each step goes to the size that took it, the tail after the last step to the last size
    (a soak ending mid-recovery still charges its time)."""
    if any(b.t_s < a.t_s for a, b in zip(steps, steps[1:])):
        raise ValueError("steps must be in the order they were taken")
    count: dict[int, int] = {}
    wall: dict[int, float] = {}
    last = 0.0
    for s in steps:
        count[s.size] = count.get(s.size, 0) + 1
        wall[s.size] = wall.get(s.size, 0.0) + s.t_s - last
        last = s.t_s
    if steps:
        wall[steps[-1].size] += max(0.0, end_s - last)
    out = []
    for size in sorted(count):
        per, measured = fault_free_step_s(size, baseline)
        out.append(SizeShare(size=size, steps=count[size], s=wall[size], fault_free_step_s=per,
                             fault_free_s=count[size] * per, measured=measured))
    return out


def goodput(parts: list[SizeShare], *, wall_s: float) -> float:
    """The fault-free time of the soak's steps, each at its size, over the soak's wall time."""
    if wall_s <= 0:
        raise ValueError(f"the soak's wall time must be positive, got {wall_s}")
    return sum(p.fault_free_s for p in parts) / wall_s


def window_fault_free_s(steps: list[StepAt], baseline: dict[int, float]) -> float:
    """What ``steps`` (a fault's window) take fault-free, each at its own size."""
    return sum(fault_free_step_s(s.size, baseline)[0] for s in steps)


# A gap between two steps longer than this is a stall (no step), not a slow step: over ten
# fault-free steps at any size the soak measures (46-93 ms).
STALL_S = 1.0


@dataclass(frozen=True, kw_only=True)
class WindowParts:
    """Where a fault's window's time lost went, each part the steps' excess over their own size's
    fault-free time: ``stall_s`` (gaps over STALL_S: no step), ``grow_s`` (the gap before the first
    step at a larger size: a grow back's pause), ``smaller_s`` (steps below the size the window
    began at), ``slow_s`` (the other steps: at the window's size, slower than fault-free: the
    fault's own slowness, e.g. a degraded link, and the load's drift, which a fault-free stretch of
    the same soak measures too)."""

    stall_s: float
    grow_s: float
    smaller_s: float
    slow_s: float
    stalls: tuple[float, ...]  # each stall's gap, seconds


def window_parts(steps: list[StepAt], *, start_s: float, end_s: float, size: int, before_s: float,
                 baseline: dict[int, float]) -> WindowParts:
    """``steps``: those in (start_s, end_s], in order; ``size``: the run's size at ``start_s``;
    ``before_s``: when the step before the window was reported (its first gap starts there)."""
    parts = {"stall": 0.0, "grow": 0.0, "smaller": 0.0, "slow": 0.0}
    stalls = []
    last, last_size = before_s, size
    for s in steps:
        gap = s.t_s - last
        excess = gap - fault_free_step_s(s.size, baseline)[0]
        if s.size > last_size:
            parts["grow"] += excess
        elif gap > STALL_S:
            parts["stall"] += excess
            stalls.append(round(gap, 2))
        elif s.size < size:
            parts["smaller"] += excess
        else:
            parts["slow"] += excess
        last, last_size = s.t_s, s.size
    return WindowParts(stall_s=round(parts["stall"], 2), grow_s=round(parts["grow"], 2),
                       smaller_s=round(parts["smaller"], 2), slow_s=round(parts["slow"], 2), stalls=tuple(stalls))


def pace_s(steps: list[StepAt], size: int) -> float | None:
    """The soak's own median seconds a step at ``size``: gaps between consecutive steps both at
    ``size`` and under STALL_S (no stall, no resize). Set beside the baseline measured before the
    soak, it shows how far the load moved the pace under every fault's window (the 30-minute soak
    of 2026-12-07 lost 3.5-22 s a minute with no fault at all)."""
    gaps = sorted(b.t_s - a.t_s for a, b in zip(steps, steps[1:])
                  if a.size == b.size == size and b.t_s - a.t_s <= STALL_S)
    if not gaps:
        return None
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
