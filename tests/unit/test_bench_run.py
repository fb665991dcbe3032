"""One very short real benchmark: DDP and zero_ray stage 2 on two Ray actors."""

from __future__ import annotations

import pytest

from benchmarks.harness.report import render_markdown
from benchmarks.harness.runner import BenchConfig, run_benchmark
from benchmarks.harness.workloads import mlp_workload

pytestmark = pytest.mark.usefixtures("ray_session")


# About 45 s on a loaded two-core machine, most of it starting actor processes (each imports torch).
@pytest.mark.slow
def test_ddp_and_zero2_produce_every_field(tmp_path: pytest.TempPathFactory) -> None:
    config = BenchConfig(systems=("ddp", "zero2"), world_size=2, steps=2, warmup=1, timeout_s=120)
    results = run_benchmark(config, workloads=[mlp_workload(width=32, depth=2, per_rank_batch=4)])
    data = results.to_dict()
    assert {"cpu_model", "logical_cpus", "torch", "ray", "date"} <= data["machine"].keys()
    ddp, zero2 = data["runs"]
    for run in (ddp, zero2):
        assert run["status"] == "ok", run["reason"]
        assert run["step_ms"]["n"] == 2 and run["step_ms"]["min"] <= run["step_ms"]["median"] <= run["step_ms"]["max"]
        assert len(run["peak_rss_bytes"]) == 2 and min(run["peak_rss_bytes"]) > 0
        assert len(run["state_bytes"]) == 2 and run["state_bytes"][0]["params"] == (32 * 32 + 32) * 2 * 4
        assert run["lo_bytes_per_step"] is None or run["lo_bytes_per_step"] > 0
        assert run["max_abs_dev"] < 1e-5 and run["params_match"] is True
    assert ddp["ratio_to_ddp"] == pytest.approx(1.0)
    assert ddp["sent_bytes_per_rank_step"] is None
    # In a step stage 2 holds half of DDP's gradients, and none after it; it says what it sent.
    numel = (32 * 32 + 32) * 2
    assert zero2["state_in_step_bytes"][0]["grads"] == numel * 4 // 2 and zero2["state_bytes"][0]["grads"] == 0
    assert ddp["state_in_step_bytes"][0]["grads"] == ddp["state_bytes"][0]["grads"] == numel * 4
    assert zero2["sent_bytes_per_rank_step"][0] >= numel * 4  # (N-1)/N * 2Ψ fp32 at N = 2, plus scalars
    assert "only 2 timed step(s)" in results.notes[0]
    assert "zero_ray stage 2" in render_markdown(results)
