"""The README's digest of a side-by-side run (``report.summary_markdown``), from fake results."""

from __future__ import annotations

from benchmarks.harness.report import machine_line, summary_markdown
from benchmarks.harness.results import BenchResults, RunResult, WorkloadInfo
from benchmarks.harness.runner import _with_ddp_ratio
from benchmarks.harness.stats import Summary


def _run(model: str, system: str, label: str, median: float | None, state: int = 4096) -> RunResult:
    if median is None:
        return RunResult(model=model, system=system, label=label, status="unavailable", reason="not installed",
                         world_size=2)
    return RunResult(model=model, system=system, label=label, status="ok", world_size=2,
                     step_ms=Summary(median=median, min=median, max=median, n=10),
                     state_bytes=({"params": state, "grads": 0, "optimizer": 0, "total": state},),
                     state_in_step_bytes=(({"params": state, "grads": 1024, "optimizer": 0, "total": state + 1024},)
                                          if system.startswith("zero") else ()),
                     sent_bytes_per_rank_step=(2048,) if system.startswith("zero") else None)


def test_one_row_per_system_with_every_model_side_by_side() -> None:
    runs = []
    for model, scale in (("mlp", 1.0), ("gpt", 2.0)):
        runs += _with_ddp_ratio([_run(model, "ddp", "PyTorch DDP", 100.0 * scale),
                                 _run(model, "zero2", "zero_ray stage 2", 95.0 * scale, state=2048),
                                 _run(model, "ds3", "DeepSpeed ZeRO-3", None)])
    machine = {"cpu_model": "Test CPU", "date": "2026-01-01", "loadavg_start": [0.2, 0.1, 0.1],
               "loadavg_end": [0.3, 0.2, 0.1], "torch": "2.13.0", "ray": "2.60.0"}
    results = BenchResults(machine=machine, settings={"world_size": 2},
                           workloads=tuple(WorkloadInfo(name=m, description=m, num_params=1, global_batch=2)
                                           for m in ("mlp", "gpt")), runs=tuple(runs))
    md = summary_markdown(results)
    assert md.startswith(machine_line(machine))
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0] == ("| system | mlp: step ms (× DDP) | mlp: state/rank after / in step | mlp: sent/rank/step | "
                        "gpt: step ms (× DDP) | gpt: state/rank after / in step | gpt: sent/rank/step |")
    assert lines[1] == "| PyTorch DDP | 100.0 (1.00) | 4.00 KiB / — | — | 200.0 (1.00) | 4.00 KiB / — | — |"
    assert lines[2] == ("| zero_ray stage 2 | 95.0 (0.95) | 2.00 KiB / 3.00 KiB | 2.00 KiB | 190.0 (0.95) | "
                        "2.00 KiB / 3.00 KiB | 2.00 KiB |")
    assert lines[3] == "| DeepSpeed ZeRO-3 | unavailable | — | — | unavailable | — | — |"
