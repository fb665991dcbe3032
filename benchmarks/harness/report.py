"""Render benchmark results: a markdown table per model, the JSON file, a PNG bar chart."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.harness.compile_gain import COMPILE_NOTE, compile_gains, compile_table
from benchmarks.harness.results import BenchResults, RunResult

_MIB = float(2**20)

COLUMNS = ("system", "median step (ms)", "min – max (ms)", "× DDP", "peak RSS/rank", "model state/rank",
           "in-step state/rank",
           "sent/rank/step", "paper sent/rank/step", "lo bytes/step", "load 1m", "max abs Δ vs single", "match")


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units, about three significant figures: 0 B, 512 B, 1.50 KiB, 33.0 MiB."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "—"
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}" if abs(value) >= 10 else f"{value:.2f} {unit}"


def _count(n: object, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _largest(values: Sequence[int]) -> int | None:
    return max(values) if values else None


def row(r: RunResult) -> list[str]:
    """One table row; per-rank values are the largest rank's."""
    if not r.ok:
        reason = (r.reason or "").replace("|", "\\|")
        return [r.label, f"{r.status}: {reason}"] + ["—"] * (len(COLUMNS) - 2)
    assert r.step_ms is not None
    state = _largest([s["total"] for s in r.state_bytes])
    in_step = _largest([s["total"] for s in r.state_in_step_bytes])
    sent = _largest(r.sent_bytes_per_rank_step) if r.sent_bytes_per_rank_step is not None else None
    match = "—" if r.params_match is None else ("yes" if r.params_match else "no")
    return [
        r.label,
        _ms(r.step_ms.median),
        f"{_ms(r.step_ms.min)} – {_ms(r.step_ms.max)}",
        f"{r.ratio_to_ddp:.2f}" if r.ratio_to_ddp is not None else "—",
        fmt_bytes(_largest(r.peak_rss_bytes)),
        fmt_bytes(state),
        fmt_bytes(in_step),
        fmt_bytes(sent),
        fmt_bytes(r.paper_bytes_per_rank_step),
        fmt_bytes(r.lo_bytes_per_step),
        "—" if r.loadavg_1m is None else f"{r.loadavg_1m[0]:.1f} → {r.loadavg_1m[1]:.1f}",
        f"{r.max_abs_dev:.2e}" if r.max_abs_dev is not None else "—",
        match,
    ]


def _table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(m: Mapping[str, Any], *, libraries: Sequence[str] = ("torch", "ray", "deepspeed")) -> str:
    """The one line that says where numbers come from (``runner.machine_info()`` plus
    ``loadavg_end``): date, CPU, cores, load average before and after, library versions."""
    parts = [str(m.get("date", "?")), str(m.get("cpu_model", "?")),
             f"{m.get('physical_cores') or '?'} cores / {m.get('logical_cpus', '?')} logical CPUs",
             f"load {m.get('loadavg_start')} → {m.get('loadavg_end')}"]
    parts += [f"{lib} {m.get(lib) or 'not installed'}" for lib in libraries]
    return " · ".join(parts)


def render_markdown(results: BenchResults) -> str:
    """The whole report: machine and settings, one table per model, then the notes."""
    m, s = results.machine, results.settings
    opt = s.get("optimizer", {})
    out = ["# zero_ray side-by-side benchmark", ""]
    out.append(machine_line(m))
    out.append("")
    out.append(f"World size {s.get('world_size')} (one CPU and one torch thread per rank, {s.get('backend', 'gloo')}, "
               f"{s.get('dtype', 'float32')}); {_count(s.get('steps'), 'timed step')} after "
               f"{_count(s.get('warmup'), 'warm-up step')}; "
               f"AdamW(lr={opt.get('lr')}, weight_decay={opt.get('weight_decay')}); "
               f"match: max abs Δ ≤ {s.get('atol')}.")
    for w in results.workloads:
        out += ["", f"## {w.name}: {w.description}", "",
                f"{w.num_params:,} parameters, global batch {w.global_batch}.", ""]
        out.append(_table([row(r) for r in results.runs_for(w.name)]))
        compiled = compile_table(results.runs_for(w.name))
        if compiled is not None:
            out += ["", f"### {w.name}: compiled vs eager", "", compiled]
    out += ["", "Step time is the driver's wall clock per step (batch dispatch through Ray included, the same for "
                "every system); × DDP divides medians. Per-rank columns show the largest rank. Peak RSS is VmHWM "
                "during the warm-up and timed steps (reset after setup). Model state counts the parameters, "
                "gradients and optimizer state each rank holds after a step, from the tensors themselves; "
                "in-step state counts them where a step holds the most, when the optimizer's update begins "
                "(every gradient present; zero_ray: its own count at that point), in a warm-up step. "
                "sent/rank/step is the system's own count (zero_ray: comm_report()); paper is the ZeRO paper's "
                "ring volume for the stage the design matches, (N-1)/N x 2Ψ or 3Ψ fp32 elements. lo bytes/step "
                "is the loopback interface's tx counter over the timed steps divided by steps: all ranks "
                "together plus Ray's own local traffic (and anything else local on the machine). load 1m is the "
                "machine's 1-minute load average before and after the system's timed steps (the systems run one "
                "after another; on a shared machine a high value marks a row timed beside other work)."]
    if compile_gains(results.runs):
        out += ["", COMPILE_NOTE]
    notes = list(results.notes) + _lo_bursts(results)
    if notes:
        out += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def summary_markdown(results: BenchResults) -> str:
    """The README's digest of a run: its machine line and one row per system with, per model,
    the median step and its ratio to DDP, model state per rank after a step and inside one, and
    bytes sent per rank (the full table is ``render_markdown``'s)."""
    models = [w.name for w in results.workloads]
    systems = list(dict.fromkeys(r.system for r in results.runs))
    header = ["system"] + [f"{m}: {c}" for m in models for c in ("step ms (× DDP)", "state/rank after / in step",
                                                                    "sent/rank/step")]
    lines = [machine_line(results.machine), "",
             "| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for name in systems:
        cells: list[str] = []
        label = next(r.label for r in results.runs if r.system == name)
        for m in models:
            r = next((x for x in results.runs_for(m) if x.system == name), None)
            if r is None or not r.ok or r.step_ms is None:
                cells += [r.status if r is not None else "—", "—", "—"]
                continue
            full = row(r)
            ratio = f" ({r.ratio_to_ddp:.2f})" if r.ratio_to_ddp is not None else ""
            state = f"{full[COLUMNS.index('model state/rank')]} / {full[COLUMNS.index('in-step state/rank')]}"
            cells += [_ms(r.step_ms.median) + ratio, state, full[COLUMNS.index("sent/rank/step")]]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines) + "\n"


# A mean this far above the per-step median means a few steps carried traffic the others did
# not: on a shared machine, most likely someone else's.
_BURST_FACTOR = 1.5
# Idle background (rate x step time) above this share of a step's count makes the count noise.
_BACKGROUND_SHARE = 0.1
# ... and above this many bytes: Ray's heartbeats alone are a few KiB a step, which only matters
# for a system that sends nothing (the single process) and says nothing about the others.
_BACKGROUND_FLOOR = 64 * 1024


def _lo_bursts(results: BenchResults) -> list[str]:
    """Notes naming the runs whose loopback count is inflated by other traffic."""
    hit = [f"{r.model}/{r.system} ({fmt_bytes(r.lo_bytes_per_step)} vs median {fmt_bytes(r.lo_bytes_step_median)})"
           for r in results.runs
           if r.ok and r.lo_bytes_per_step is not None and r.lo_bytes_step_median is not None
           and r.lo_bytes_per_step > max(_BURST_FACTOR * r.lo_bytes_step_median,
                                         r.lo_bytes_step_median + _BACKGROUND_FLOOR)]
    notes = []
    if hit:
        notes.append("lo bytes/step exceeds its per-step median by more than "
                     f"{_BURST_FACTOR}x for {', '.join(hit)}: other local traffic during some steps; "
                     "the medians (lo_bytes_step_median in the JSON) are the better estimate there")
    noisy = []
    for r in results.runs:
        if not (r.ok and r.step_ms and r.lo_idle_bytes_per_s is not None and r.lo_bytes_per_step):
            continue
        background = r.lo_idle_bytes_per_s * r.step_ms.median / 1e3
        if background > max(_BACKGROUND_SHARE * r.lo_bytes_per_step, _BACKGROUND_FLOOR):
            noisy.append(f"{r.model}/{r.system} (~{fmt_bytes(background)} of {fmt_bytes(r.lo_bytes_per_step)})")
    if noisy:
        notes.append(f"background loopback traffic, measured with the system idle, is over "
                     f"{_BACKGROUND_SHARE:.0%} of lo bytes/step for {', '.join(noisy)}: the machine's other local "
                     "traffic is in those counts; rerun on a quiet machine")
    return notes


def write_json(results: BenchResults, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results.to_dict(), f, indent=2, sort_keys=False)
        f.write("\n")


def read_json(path: str) -> BenchResults:
    with open(path, encoding="utf-8") as f:
        return BenchResults.from_dict(json.load(f))


def write_png(results: BenchResults, path: str) -> str | None:
    """Bar charts per model: median step time (min-max whiskers) and per-rank memory. Returns
    None when written, or a note saying why not (matplotlib missing, nothing ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark machine
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'zero-ray[bench]'): PNG skipped"
    models = [w.name for w in results.workloads if any(r.ok for r in results.runs_for(w.name))]
    if not models:
        return "no system ran: PNG skipped"
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.2 + 0.9 * len(models) * 3), squeeze=False)
    for i, model in enumerate(models):
        runs = [r for r in results.runs_for(model) if r.ok and r.step_ms is not None]
        labels = [r.label for r in runs]
        ys = range(len(runs))
        med = [r.step_ms.median for r in runs]  # type: ignore[union-attr]
        lo = [r.step_ms.median - r.step_ms.min for r in runs]  # type: ignore[union-attr]
        hi = [r.step_ms.max - r.step_ms.median for r in runs]  # type: ignore[union-attr]
        ax = axes[i][0]
        ax.barh(list(ys), med, xerr=[lo, hi], color="#4c72b0", capsize=3)
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        ax.set_xlabel("median step time (ms), whiskers min–max")
        ax.set_title(f"{model}: step time")
        ax = axes[i][1]
        state = [max(s["total"] for s in r.state_bytes) / _MIB for r in runs]
        rss = [max(r.peak_rss_bytes) / _MIB for r in runs]
        height = 0.4
        ax.barh([y - height / 2 for y in ys], state, height=height, label="model state / rank", color="#55a868")
        ax.barh([y + height / 2 for y in ys], rss, height=height, label="peak RSS / rank", color="#c44e52")
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.3 * max(state + rss))  # room on the right for the legend
        ax.set_xlabel("MiB")
        ax.set_title(f"{model}: memory per rank")
        ax.legend(loc="lower right", fontsize="small")
    m = results.machine
    fig.suptitle(f"world size {results.settings.get('world_size')} · {m.get('cpu_model')} · {m.get('date')}",
                 fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
