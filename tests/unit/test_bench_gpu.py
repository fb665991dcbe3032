"""The arithmetic and report of benchmarks.gpu_check (which itself needs a GPU)."""

from __future__ import annotations

import sys

import pytest

from benchmarks.harness.gpu import MemoryCheck, bf16_peak, flops_per_token, markdown, mfu, summarize_junit
from tests_paths import REPO_ROOT
from zero_ray.errors import ConfigError
from zero_ray.models import GPT, GPTConfig


def test_peaks_by_device_name() -> None:
    assert bf16_peak("NVIDIA H200") == 989.4e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756.0e12
    assert bf16_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert bf16_peak("NVIDIA A100-SXM4-80GB") == 312.0e12
    assert bf16_peak("Tesla T4") is None


def test_model_flops_and_utilisation() -> None:
    # 1B parameters, 18 layers of width 2048 at sequence 2048: 6N + 12 L h s per token.
    per_token = flops_per_token(num_params=10**9, n_layer=18, n_embd=2048, seq_len=2048)
    assert per_token == 6e9 + 12 * 18 * 2048 * 2048
    assert mfu(tokens_per_s=50_000, flops_per_token=per_token, peak_flops=989.4e12, devices=1) == pytest.approx(
        50_000 * per_token / 989.4e12)
    assert mfu(tokens_per_s=2, flops_per_token=1.0, peak_flops=1.0, devices=2) == 1.0
    with pytest.raises(ConfigError, match="n_layer=0 must be >= 1"):
        flops_per_token(num_params=1, n_layer=0, n_embd=1, seq_len=1)


def test_memory_check_within_five_percent() -> None:
    ok = MemoryCheck(measured=104, model_state=60, buffers=10, activations=30)
    assert ok.expected == 100 and ok.deviation == pytest.approx(0.04) and ok.within
    assert not MemoryCheck(measured=94, model_state=60, buffers=10, activations=30).within


def test_the_parameter_count_gpu_check_uses_is_the_models() -> None:
    if REPO_ROOT not in sys.path:  # benchmarks/ is a top-level package of the checkout
        sys.path.insert(0, REPO_ROOT)
    from benchmarks.gpu_check import _gpt_params

    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=3, n_head=2, n_embd=24)
    assert _gpt_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_the_report_renders_tests_throughput_and_memory() -> None:
    tests = summarize_junit([{"name": "a", "outcome": "passed"}, {"name": "b::c", "outcome": "failed"},
                             {"name": "d", "outcome": "skipped"}])
    assert tests == {"passed": 1, "failed": 1, "skipped": 1, "failures": ["b::c"]}
    result = {"device": "NVIDIA H200", "gpus": 1, "date": "2026-12-03", "tests": {**tests, "seconds": 61.0},
              "throughput": {"num_params": 1_013_600_000, "n_layer": 18, "n_embd": 2048, "seq_len": 2048,
                             "world_size": 1, "tokens_per_step": 16384, "steps": 10, "warmup": 3, "step_s": 0.25,
                             "tokens_per_s": 65536.0, "mfu": 0.431, "peak_flops": 989.4e12,
                             "memory": [{"rank": 0, "measured": 40 * 2**30, "model_state": 16 * 2**30,
                                         "buffers": 2**30, "activations": 22 * 2**30, "expected": 39 * 2**30,
                                         "deviation": 1 / 39, "fragmentation": 2**29}]},
              "notes": ["a note"]}
    text = markdown(result)
    assert "1 passed, 1 failed, 1 skipped (61 s)" in text and "- failed: `b::c`" in text
    assert "| 65,536 | 0.250 | 43.1% | 40% | 989 |" in text
    assert "| 0 | 40.00 | 16.00 | 1.00 | 22.00 | 39.00 | +2.6% | 0.50 |" in text
    assert text.rstrip().endswith("a note")
