"""What torch.compile gains each system: its compiled run's speedup over its own eager run, and
that speedup against single-process torch's (issue 34's goal: zero_ray keeps >= 0.9 of it).

Pure: computed from the results (so ``--render`` of an old JSON file shows it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.results import RunResult

#: what a system's name ends with when its blocks are torch.compile'd; the rest is its eager twin
COMPILE_SUFFIX = "+compile"

#: the system whose compiled speedup the others are held to
REFERENCE = "single+compile"
#: issue 34: a zero_ray stage's compiled speedup over its eager step, divided by single-process
#: torch's, should be at least this
GOAL = 0.9


def compiled_name(name: str, label: str, compile: bool) -> tuple[str, str]:
    """The command-line name and table label of a system, compiled or not."""
    return (name + COMPILE_SUFFIX, label + " + compile") if compile else (name, label)


def eager_twin(name: str) -> str | None:
    """The eager system a compiled one is measured against (``zero2+compile`` -> ``zero2``);
    None for a system that is not compiled."""
    return name[: -len(COMPILE_SUFFIX)] if name.endswith(COMPILE_SUFFIX) else None


@dataclass(frozen=True, kw_only=True)
class CompileGain:
    """One compiled system beside its eager twin, on one model (times in milliseconds).

    speedup: eager median step / compiled median step (above 1: compiling helped).
    of_single: ``speedup`` / single-process torch's compiled speedup on the same model; None for
        the single process itself or where it has no pair of runs.
    first_step_ms / eager_first_step_ms: the first step of each (the compiled one compiles).
    """

    model: str
    system: str
    label: str
    eager_ms: float
    compiled_ms: float
    speedup: float
    of_single: float | None
    first_step_ms: float | None
    eager_first_step_ms: float | None


def _median(r: RunResult | None) -> float | None:
    if r is None or not r.ok or r.step_ms is None or r.step_ms.median <= 0:
        return None
    return r.step_ms.median


def _pair(runs: Sequence[RunResult], compiled: RunResult) -> RunResult | None:
    twin = eager_twin(compiled.system)
    return next((r for r in runs if r.model == compiled.model and r.system == twin), None)


def _speedup(runs: Sequence[RunResult], compiled: RunResult) -> float | None:
    eager_ms, compiled_ms = _median(_pair(runs, compiled)), _median(compiled)
    return eager_ms / compiled_ms if eager_ms is not None and compiled_ms is not None else None


def compile_gains(runs: Sequence[RunResult]) -> list[CompileGain]:
    """One entry per compiled run (in run order) whose own and eager twin's runs are both ok."""
    out = []
    for r in runs:
        if eager_twin(r.system) is None:
            continue
        speedup, eager = _speedup(runs, r), _pair(runs, r)
        if speedup is None or eager is None or eager.step_ms is None or r.step_ms is None:
            continue
        single = next((x for x in runs if x.model == r.model and x.system == REFERENCE), None)
        base = _speedup(runs, single) if single is not None and r.system != REFERENCE else None
        out.append(CompileGain(model=r.model, system=r.system, label=r.label, eager_ms=eager.step_ms.median,
                               compiled_ms=r.step_ms.median, speedup=speedup,
                               of_single=speedup / base if base else None, first_step_ms=r.first_step_ms,
                               eager_first_step_ms=eager.first_step_ms))
    return out


def _s(ms: float | None) -> str:
    return "—" if ms is None else f"{ms / 1e3:.1f}"


def compile_table(runs: Sequence[RunResult]) -> str | None:
    """The markdown table of ``compile_gains(runs)`` (one model's runs); None when it is empty."""
    gains = compile_gains(runs)
    if not gains:
        return None
    lines = ["| compiled system | eager median (ms) | compiled median (ms) | speedup | ÷ single's speedup "
             "| first step eager → compiled (s) |", "|---|---:|---:|---:|---:|---:|"]
    for g in gains:
        ratio = "—" if g.of_single is None else f"{g.of_single:.2f}"
        lines.append(f"| {g.label} | {g.eager_ms:.1f} | {g.compiled_ms:.1f} | {g.speedup:.2f} | {ratio} "
                     f"| {_s(g.eager_first_step_ms)} → {_s(g.first_step_ms)} |")
    return "\n".join(lines)


COMPILE_NOTE = (f"Compiled vs eager: speedup is the eager twin's median step divided by the compiled system's; "
                f"÷ single's speedup divides it by single-process torch's (issue 34's goal for zero_ray: "
                f">= {GOAL}). The first step (warm-up) is where the blocks compile; inductor's on-disk cache "
                f"is shared by every system on the machine, so a system after the first compiled one mostly "
                f"reads compiled kernels rather than building them.")
