"""Rendering of benchmark results (markdown, JSON round trip, PNG) from fake results, and the
benchmark's configuration and command line."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.compare import add_arguments, config_from_args
from benchmarks.harness.report import fmt_bytes, read_json, render_markdown, row, write_json, write_png
from benchmarks.harness.results import BenchResults, RunResult, WorkloadInfo
from benchmarks.harness.runner import BenchConfig, _with_ddp_ratio, max_abs_deviation
from benchmarks.harness.stats import Summary
from zero_ray.errors import ConfigError


def _ok(system: str, label: str, median: float, *, sent: tuple[int, ...] | None = None) -> RunResult:
    return RunResult(model="mlp", system=system, label=label, status="ok", world_size=2,
                     step_ms=Summary(median=median, min=median * 0.9, max=median * 1.5, n=10),
                     rank_step_ms=Summary(median=median * 0.8, min=median * 0.7, max=median, n=10),
                     peak_rss_bytes=(300 * 2**20, 310 * 2**20), lifetime_peak_rss_bytes=(400 * 2**20, 410 * 2**20),
                     rss_source="VmHWM since reset",
                     state_bytes=({"params": 4096, "grads": 4096, "optimizer": 8192, "total": 16384},
                                  {"params": 4096, "grads": 2048, "optimizer": 4096, "total": 10240}),
                     state_in_step_bytes=({"params": 4096, "grads": 8192, "optimizer": 8192, "total": 20480},),
                     sent_bytes_per_rank_step=sent, sent_source="ZeroTrainer.comm_report() (last step)" if sent else None,
                     paper_bytes_per_rank_step=4096.0, lo_bytes_per_step=3.5 * 2**20, max_abs_dev=3e-8,
                     params_match=True)


def fake_results() -> BenchResults:
    runs = [
        _ok("ddp", "PyTorch DDP", 100.0),
        _ok("zero2", "zero_ray stage 2", 150.0, sent=(4096, 4100)),
        RunResult(model="mlp", system="ds1", label="DeepSpeed ZeRO-1", status="unavailable", world_size=2,
                  reason="deepspeed is not installed | really"),
        RunResult(model="mlp", system="fsdp2", label="FSDP2 fully_shard", status="failed", world_size=2,
                  reason="after 4 steps: RuntimeError: boom"),
    ]
    return BenchResults(
        machine={"cpu_model": "Test CPU", "logical_cpus": 2, "physical_cores": 2, "torch": "2.13.0", "ray": "2.60.0",
                 "deepspeed": None, "date": "2026-01-01T00:00:00+00:00", "loadavg_start": [0.1, 0.1, 0.1]},
        settings={"world_size": 2, "steps": 10, "warmup": 3, "atol": 1e-4, "backend": "gloo", "dtype": "float32",
                  "optimizer": {"name": "AdamW", "lr": 1e-3, "weight_decay": 0.01}},
        workloads=(WorkloadInfo(name="mlp", description="mlp(1024, 8)", num_params=8_396_800, global_batch=64),),
        runs=tuple(_with_ddp_ratio(runs)), notes=("a note",))


def test_markdown_table_rows_and_context() -> None:
    md = render_markdown(fake_results())
    assert "Test CPU" in md and "torch 2.13.0" in md and "deepspeed not installed" in md
    assert "## mlp: mlp(1024, 8)" in md and "8,396,800 parameters, global batch 64" in md
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header, ddp, zero2, ds1, fsdp2 = lines
    assert "median step (ms)" in header and "lo bytes/step" in header and "× DDP" in header
    cells = [c.strip() for c in zero2.strip("|").split("|")]
    assert cells[:4] == ["zero_ray stage 2", "150.0", "135.0 – 225.0", "1.50"]
    assert cells[4] == "310 MiB"  # the largest rank
    assert cells[5] == "16.0 KiB" and cells[6] == "20.0 KiB"  # after a step, in a step
    assert cells[7] == "4.00 KiB" and cells[9] == "3.50 MiB"
    assert cells[-2:] == ["3.00e-08", "yes"]
    assert "1.00" in ddp
    # A "|" in a reason must not break the table.
    assert "unavailable: deepspeed is not installed \\| really" in ds1
    assert ds1.count(" | ") == fsdp2.count(" | ") == header.count(" | ")
    assert "failed: after 4 steps: RuntimeError: boom" in fsdp2
    assert "- a note" in md


def test_row_without_self_reported_bytes_shows_a_dash() -> None:
    assert row(_ok("ddp", "PyTorch DDP", 10.0))[7] == "—"


def test_json_round_trip(tmp_path: pytest.TempPathFactory) -> None:
    results = fake_results()
    path = os.path.join(str(tmp_path), "r.json")
    write_json(results, path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    assert data["schema"] == 1 and data["machine"]["cpu_model"] == "Test CPU"
    run = data["runs"][1]
    for key in ("step_ms", "ratio_to_ddp", "peak_rss_bytes", "state_bytes", "sent_bytes_per_rank_step",
                "lo_bytes_per_step", "max_abs_dev", "params_match", "paper_bytes_per_rank_step"):
        assert key in run, key
    assert run["step_ms"] == {"median": 150.0, "min": 135.0, "max": 225.0, "n": 10}
    assert read_json(path) == results


def test_results_validation() -> None:
    with pytest.raises(ConfigError, match="needs a reason"):
        RunResult(model="m", system="s", label="s", status="failed", world_size=1)
    with pytest.raises(ConfigError, match="not one of"):
        RunResult(model="m", system="s", label="s", status="maybe", world_size=1, reason="x")
    with pytest.raises(ConfigError, match="schema"):
        BenchResults.from_dict({"schema": 0})


def test_png(tmp_path: pytest.TempPathFactory) -> None:
    pytest.importorskip("matplotlib")
    path = os.path.join(str(tmp_path), "r.png")
    assert write_png(fake_results(), path) is None
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (33 * 2**20, "33.0 MiB"),
                                     (300 * 2**20, "300 MiB"), (None, "—")])
def test_fmt_bytes(n: float | None, text: str) -> None:
    assert fmt_bytes(n) == text


def test_max_abs_deviation() -> None:
    import torch

    ref = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    assert max_abs_deviation({"a": torch.tensor([0.0, -0.5, 0.1]), "b": torch.ones(2, 2)}, ref) == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="missing"):
        max_abs_deviation({"a": torch.zeros(3)}, ref)
    with pytest.raises(ConfigError, match="shape"):
        max_abs_deviation({"a": torch.zeros(4), "b": torch.ones(2, 2)}, ref)


@pytest.mark.parametrize("kwargs, match", [
    ({"systems": ("ddp", "nope")}, "unknown systems"),
    ({"systems": ()}, "selects nothing"),
    ({"systems": ("ddp", "ddp")}, "twice"),
    ({"models": ("resnet",)}, "unknown models"),
    ({"world_size": 0}, "world_size=0"),
    ({"steps": 0}, "steps=0"),
    ({"lr": -1.0}, "lr=-1.0"),
])
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BenchConfig(**kwargs)  # type: ignore[arg-type]


def test_command_line() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--systems", "ddp,zero2", "--model", "gpt", "--world-size", "3",
                                              "--steps", "12"]))
    assert cfg.systems == ("ddp", "zero2") and cfg.models == ("gpt",) and cfg.world_size == 3 and cfg.steps == 12
    assert config_from_args(parser.parse_args(["--model", "all"])).models == ("mlp", "gpt")
    with pytest.raises(SystemExit):
        parser.parse_args(["--systems", "ddp,bogus"])


def test_loopback_bursts_are_flagged() -> None:
    import dataclasses

    results = fake_results()
    assert "other local traffic" not in render_markdown(results)  # no medians recorded: nothing to compare
    runs = list(results.runs)
    runs[0] = dataclasses.replace(runs[0], lo_bytes_per_step=10 * 2**20, lo_bytes_step_median=2**20)
    runs[1] = dataclasses.replace(runs[1], lo_bytes_per_step=2**20, lo_bytes_step_median=2**20)
    md = render_markdown(dataclasses.replace(results, runs=tuple(runs)))
    assert "mlp/ddp (10.0 MiB vs median 1.00 MiB)" in md and "mlp/zero2" not in md


def test_loopback_background_is_flagged() -> None:
    import dataclasses

    results = fake_results()
    runs = list(results.runs)
    # 100 ms steps with 10 MiB/s idle traffic: ~1 MiB of each step's 3.5 MiB is background.
    runs[0] = dataclasses.replace(runs[0], lo_idle_bytes_per_s=10 * 2**20)
    runs[1] = dataclasses.replace(runs[1], lo_idle_bytes_per_s=1024.0)
    md = render_markdown(dataclasses.replace(results, runs=tuple(runs)))
    assert "background loopback traffic" in md and "mlp/ddp (~1.00 MiB of 3.50 MiB)" in md
    assert "mlp/zero2 (~" not in md
