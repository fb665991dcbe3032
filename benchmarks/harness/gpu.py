"""The arithmetic of ``benchmarks.gpu_check``: model FLOPs, utilisation against the device's
peak, memory against the formula, and the result table. Pure: no torch, no ray."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zero_ray.errors import ConfigError

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched against
# torch.cuda.get_device_name(); the first name contained in it wins.
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
    ("A10G", 70.0e12),
)

MEMORY_TOLERANCE = 0.05  # the bound: within 5% of formula plus measured activations
MFU_TARGET = 0.40


def bf16_peak(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None for a device not in the table."""
    for name, peak in BF16_PEAK_FLOPS:
        if name.lower() in device_name.lower():
            return peak
    return None


def flops_per_token(*, num_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6 per parameter (forward 2, backward 4) plus
    causal attention's scores and values, 12 x layers x width x sequence (PaLM, appendix B;
    not halved for the causal mask, as that paper counts). Recomputation is not counted (model
    FLOPs, not hardware FLOPs)."""
    for name, value in (("num_params", num_params), ("n_layer", n_layer), ("n_embd", n_embd), ("seq_len", seq_len)):
        if value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    return 6.0 * num_params + 12.0 * n_layer * n_embd * seq_len


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float, devices: int) -> float:
    """Model-FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    if not (peak_flops > 0 and devices >= 1):
        raise ConfigError(f"peak_flops={peak_flops} and devices={devices} must be positive")
    return tokens_per_s * flops_per_token / (peak_flops * devices)


@dataclass(frozen=True, kw_only=True)
class MemoryCheck:
    """One rank's peak allocated bytes against the model-state formula plus what it adds."""

    measured: int  # torch.cuda's peak allocated bytes on the rank
    model_state: int  # the paper's formula for the stage (16Ψ/N at stage 3)
    buffers: int  # gathered and reduce buffers (ZeRO-R's constant-size buffers)
    activations: int  # measured separately: what a forward keeps for backward

    @property
    def expected(self) -> int:
        return self.model_state + self.buffers + self.activations

    @property
    def deviation(self) -> float:
        return (self.measured - self.expected) / self.expected if self.expected else math.inf

    @property
    def within(self) -> bool:
        return abs(self.deviation) <= MEMORY_TOLERANCE


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def markdown(result: Mapping[str, Any]) -> str:
    """benchmarks/results/gpu.md from gpu_check's JSON result."""
    tests = result.get("tests", {})
    lines = [f"# GPU check ({result.get('device', '?')} x {result.get('gpus', 0)})", "",
             f"Command: `{result.get('command', 'python -m benchmarks.gpu_check')}`, {result.get('date', '')}", "",
             "## GPU tests", "",
             f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped "
             f"({tests.get('seconds', 0):.0f} s)."]
    for name in tests.get("failures", []):
        lines.append(f"- failed: `{name}`")
    run = result.get("throughput")
    if run:
        mfu_text = "-" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
        peak_text = "-" if run["peak_flops"] is None else f"{run['peak_flops'] / 1e12:.0f}"
        lines += ["", "## Throughput", "",
                  f"GPT of {run['num_params'] / 1e9:.2f}B parameters ({run['n_layer']} layers, width {run['n_embd']}, "
                  f"sequence {run['seq_len']}), bf16, ZeRO stage 3, world size {run['world_size']}, "
                  f"{run['tokens_per_step']:,} tokens per step, median of {run['steps']} steps after "
                  f"{run['warmup']} warm-up steps.", "",
                  "| tokens/s | step s | MFU | MFU target | peak bf16 TFLOP/s |", "|---:|---:|---:|---:|---:|",
                  f"| {run['tokens_per_s']:,.0f} | {run['step_s']:.3f} | {mfu_text} | {100 * MFU_TARGET:.0f}% | "
                  f"{peak_text} |",
                  "", "| rank | peak allocated GiB | formula GiB | buffers GiB | activations GiB | expected GiB | "
                  "deviation | fragmentation GiB |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in run["memory"]:
            lines.append(f"| {r['rank']} | {_gib(r['measured'])} | {_gib(r['model_state'])} | {_gib(r['buffers'])} | "
                         f"{_gib(r['activations'])} | {_gib(r['expected'])} | {100 * r['deviation']:+.1f}% | "
                         f"{_gib(r['fragmentation'])} |")
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def summarize_junit(cases: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """Counts from pytest's JUnit XML test cases (``{"name", "outcome"}`` each)."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in cases:
        outcome = case["outcome"]
        out[outcome] = out.get(outcome, 0) + 1
        if outcome == "failed":
            out["failures"].append(case["name"])
    return out
