"""The runner's handling of systems that cannot run or break (fake systems, no Ray), and the
command line's --render path."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from benchmarks.compare import main
from benchmarks.harness.probe import MemoryProbe, StateBytes
from benchmarks.harness.report import write_json
from benchmarks.harness.runner import BenchConfig, run_system
from benchmarks.harness.systems import SYSTEMS, RankReport, SystemReport, SystemUnavailable, make_system
from benchmarks.harness.workloads import mlp_workload
from zero_ray.errors import ConfigError

from test_bench_report import fake_results


class FakeSystem:
    """A System that fails where it is told to, and records what the runner called."""

    name = "fake"
    label = "fake system"
    paper_stage: int | None = 0

    def __init__(self, *, fail_in: str | None = None, availability_by_trial: bool = False,
                 error: Exception | None = None) -> None:
        self.fail_in = fail_in
        self.availability_by_trial = availability_by_trial
        self.error = error or RuntimeError("gloo does not support this")
        self.calls: list[str] = []
        self.module = torch.nn.Linear(2, 2)

    def _maybe_fail(self, where: str) -> None:
        self.calls.append(where)
        if self.fail_in == where:
            raise self.error

    def world_size(self, requested: int) -> int:
        return requested

    def check_available(self) -> None:
        self._maybe_fail("check_available")

    def setup(self, ctx: Any) -> None:
        self._maybe_fail("setup")

    def reset_peaks(self) -> None:
        self.calls.append("reset_peaks")

    def step(self, batch: Any) -> float | None:
        self._maybe_fail("step")
        return 0.001

    def report(self) -> SystemReport:
        probe = MemoryProbe(peak_rss_bytes=1, lifetime_peak_rss_bytes=2, source="VmHWM since reset", pid=1)
        rank = RankReport(memory=probe, state=StateBytes(params=1, grads=2, optimizer=3), sent_bytes_per_step=None)
        return SystemReport(ranks=(rank, rank), sent_source=None)

    def final_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def _run(system: FakeSystem, **config: Any) -> Any:
    cfg = BenchConfig(systems=("ddp",), **{"steps": 4 - config.get("warmup", 1), "warmup": 1, **config})
    workload = mlp_workload(width=2, depth=1, per_rank_batch=1)
    batches = workload.batches(4, world_size=2, seed=0)
    return run_system(system, workload=workload, config=cfg, batches=batches, reference=system.final_params(),
                      num_params=6)


def test_ok_run_summarises_the_timed_steps_only() -> None:
    system = FakeSystem()
    result = _run(system)
    assert result.ok and result.step_ms.n == 3 and result.rank_step_ms.median == pytest.approx(1.0)
    assert result.max_abs_dev == 0.0 and result.params_match is True
    if os.path.exists("/proc/net/dev"):
        assert result.lo_bytes_per_step >= 0 and result.lo_bytes_step_median >= 0
        assert result.lo_idle_bytes_per_s >= 0
    assert result.state_bytes[0] == {"params": 1, "grads": 2, "optimizer": 3, "total": 6}
    assert result.paper_bytes_per_rank_step == pytest.approx(4 * 6)  # (N-1)/N * 2Ψ at N = 2, fp32
    assert system.calls == ["check_available", "setup", "reset_peaks"] + ["step"] * 4 + ["shutdown"]


class SlowFirstStep(FakeSystem):
    """A system whose first step takes 50 ms (a compiled system's compilation)."""

    def step(self, batch: Any) -> float | None:
        if "step" not in self.calls:
            time.sleep(0.05)
        return super().step(batch)


@pytest.mark.parametrize("warmup", [1, 0])
def test_first_step_is_timed_apart_from_the_timed_steps(warmup: int) -> None:
    result = _run(SlowFirstStep(), warmup=warmup)
    assert result.first_step_ms >= 50
    # with a warm-up step the slow one is not among the timed ones; without, it is their first
    assert (result.step_ms.max < 50) == (warmup == 1) and result.step_ms.n == 4 - warmup


def test_unavailable_from_the_check_is_reported() -> None:
    system = FakeSystem(fail_in="check_available", error=SystemUnavailable("fake", "not installed"))
    result = _run(system)
    assert (result.status, result.reason) == ("unavailable", "not installed")
    assert system.calls[-1] == "shutdown"


def test_failure_before_the_first_step_means_unavailable_for_trial_systems() -> None:
    result = _run(FakeSystem(fail_in="step", availability_by_trial=True))
    assert result.status == "unavailable"
    assert result.reason == "failed before its first step: RuntimeError: gloo does not support this"


def test_failure_of_an_established_system_is_failed_and_shut_down() -> None:
    system = FakeSystem(fail_in="setup")
    result = _run(system)
    assert result.status == "failed" and "after 0 steps: RuntimeError" in result.reason
    assert system.calls[-1] == "shutdown"


def test_registry() -> None:
    variants = {f"zero{s}-{v}" for s in (1, 2, 3) for v in ("foreach", "fused", "hand")}  # the optimizer A/B
    compiled = {"single+compile", "ddp+compile"} | {f"zero{s}+compile" for s in range(4)}  # test_bench_compiled.py
    assert {"single", "ddp", "torch-zero", "fsdp2", "ds1", "ds2", "ds3", "zero0", "zero1", "zero2", "zero3"} | variants \
        | compiled == set(SYSTEMS)
    assert make_system("zero2").name == "zero2" and make_system("ds3").label == "DeepSpeed ZeRO-3"
    assert make_system("zero1-fused").label == "zero_ray stage 1 (fused AdamW)"
    with pytest.raises(ConfigError, match="unknown system 'x'"):
        make_system("x")


def test_render_existing_results(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    src = os.path.join(str(tmp_path), "in.json")
    write_json(fake_results(), src)
    out = os.path.join(str(tmp_path), "out")
    assert main(["--render", src, "--output-dir", out, "--no-png"]) == 0
    printed = capsys.readouterr().out
    assert "| zero_ray stage 2 | 150.0 |" in printed
    with open(os.path.join(out, "compare.md"), encoding="utf-8") as f:
        assert f.read() == printed.rstrip("\n") + "\n"
