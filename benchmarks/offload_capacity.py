"""``python -m benchmarks.offload_capacity``: the largest model four owners train on this machine,
in memory and with the optimizer state and parameters on local disk (issue 33's goal: with NVMe
offload, a model whose full training state, 16Ψ for fp32 AdamW, is at least 1.5x the machine's
memory).

    python -m benchmarks.offload_capacity --layers 46 --width 2048 --offload --path /var/tmp/zr
    python -m benchmarks.offload_capacity --layers 12 --width 2048 --cap

Each run is one model size: Hugging Face GPT-2 built from a config (``--layers`` x ``--width``,
vocabulary 50257), stage 3 on four CPU owners with the low-memory construction (no owner ever
holds a whole parameter it does not own) and each ``GPT2Block`` a unit (the embeddings and the
final LayerNorm are the root's), fp32 AdamW, three steps on one fixed batch of four
sequences (one per owner), so a model that trains shows a falling loss. ``--offload`` passes
``Offload(optimizer="nvme", params="nvme", path=--path)``. ``--cap`` caps each owner's address
space at what it maps when ``model_fn`` starts plus a quarter of the machine's memory less 3 GiB
(left to the driver, Ray and the page cache; RLIMIT_AS,
as ``benchmarks.stage3_capacity`` does), so that a model too large for memory fails with a
``MemoryError`` instead of driving the machine into its OOM killer; it cannot be combined with
``--offload``, whose mapped files count as address space.

It reports the parameters, the full training state (16Ψ) against the machine's memory, each
step's loss and time, each owner's peak resident set (``VmHWM``, read from ``/proc/<pid>``: the
mapped state pages count while mapped), the memory report's ``nvme`` and ``resident`` bytes, the
bytes the owners read from and wrote to the disk (``/proc/<pid>/io``), and the lowest
``MemAvailable`` the machine had during the run (sampled every half second). Appends to
``benchmarks/results/offload_capacity.{json,md}`` (``--results-dir``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch

import zero_ray as zr
from benchmarks.harness.probe import cap_address_space
from benchmarks.harness.ray_env import runtime_env
from benchmarks.harness.report import machine_line
from benchmarks.harness.runner import loadavg, machine_info
from benchmarks.harness.trials import write_results
from zero_ray.config import Stage3Config

VOCAB, SEQ, OWNERS, STEPS = 50257, 32, 4, 3
GIB = 2**30
RESERVE = 3 * GIB  # left to the driver, Ray's own processes and the page cache when owners are capped


def gpt2(layers: int, width: int, cap_bytes: int | None = None) -> torch.nn.Module:
    """GPT-2 from a config (dropout off); with ``cap_bytes``, this owner's address space capped first."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if cap_bytes is not None:
        cap_address_space(cap_bytes)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=layers,
                                      n_head=max(1, width // 64), use_cache=False, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def lm_loss(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return module(input_ids=tokens, labels=tokens).loss


def param_count(layers: int, width: int) -> int:
    """GPT-2's parameters at this size (lm_head tied to wte)."""
    block = 12 * width * width + 13 * width  # attention 4w^2 + 4w, MLP 8w^2 + 5w, two LayerNorms 4w
    return VOCAB * width + SEQ * width + layers * block + 2 * width


def _meminfo(field_name: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field_name + ":"))


def _proc(pid: int, path: str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/{path}", encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    value = int(line.split()[1])
                    return value * 1024 if path == "status" else value
    except OSError:
        pass
    return 0


class Sampler:
    """The machine's lowest MemAvailable while it runs, sampled every half second."""

    def __init__(self) -> None:
        self.lowest = _meminfo("MemAvailable")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.lowest = min(self.lowest, _meminfo("MemAvailable"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.lowest


@dataclass(kw_only=True)
class CapacityRow:
    """One run (bytes and seconds)."""

    layers: int
    width: int
    params: int
    state_bytes: int  # 16 Psi: fp32 parameters, gradients and AdamW's two moments
    machine_bytes: int
    offload: bool
    capped: bool
    trained: bool = False
    error: str = ""
    build_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)  # per owner, VmHWM
    nvme: list[int] = field(default_factory=list)  # per owner, from memory_report()
    resident: list[int] = field(default_factory=list)
    read_bytes: int = 0  # all owners, from the disk
    written_bytes: int = 0
    lowest_available: int = 0


def run(args: argparse.Namespace) -> CapacityRow:
    machine = _meminfo("MemTotal")
    params = param_count(args.layers, args.width)
    row = CapacityRow(layers=args.layers, width=args.width, params=params, state_bytes=16 * params,
                      machine_bytes=machine, offload=args.offload, capped=args.cap)
    cap = (machine - RESERVE) // OWNERS if args.cap else None
    offload = zr.Offload(optimizer="nvme", params="nvme", path=args.path) if args.offload else zr.Offload()
    config = zr.ZeroConfig(stage=3, world_size=OWNERS, device="cpu", offload=offload,
                           stage3=Stage3Config(init="low_memory", wrap_policy=("GPT2Block",)),
                           init_timeout_s=3600, step_timeout_s=3600,
                           collective_timeout_s=3600, health_timeout_s=600)
    batch = torch.randint(0, VOCAB, (OWNERS, SEQ), generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    t0 = time.perf_counter()
    try:
        with zr.ZeroTrainer(functools.partial(gpt2, args.layers, args.width, cap), lm_loss,
                            optimizer=zr.AdamW(lr=1e-4), config=config) as trainer:
            row.build_s = time.perf_counter() - t0
            pids = [ray.get(a.node.remote(), timeout=60)["pid"] for a in trainer.actors]
            io0 = [(_proc(p, "io", "read_bytes"), _proc(p, "io", "write_bytes")) for p in pids]
            for step in range(STEPS):
                t1 = time.perf_counter()
                metrics = trainer.step(batch)
                row.step_s.append(round(time.perf_counter() - t1, 2))
                row.losses.append(float(metrics["loss"]))
                print(f"  step {step}: loss {row.losses[-1]:.4f} in {row.step_s[-1]:.1f} s", flush=True)
            report = trainer.memory_report()
            row.nvme = [r["nvme"] for r in report]
            row.resident = [r["resident"] for r in report]
            row.peak_rss = [_proc(p, "status", "VmHWM") for p in pids]
            row.read_bytes = sum(_proc(p, "io", "read_bytes") - r for p, (r, _) in zip(pids, io0))
            row.written_bytes = sum(_proc(p, "io", "write_bytes") - w for p, (_, w) in zip(pids, io0))
        row.trained = all(math.isfinite(x) for x in row.losses) and row.losses[-1] < row.losses[0]
    except zr.ZeroRayError as err:
        row.build_s = row.build_s or time.perf_counter() - t0
        row.error = str(err).splitlines()[0][:200]
    row.lowest_available = sampler.stop()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | Ψ | 16Ψ / memory | where | trained | losses | build s | steps s | peak RSS per owner GiB "
            "| on disk per owner GiB | disk read / written GiB | lowest MemAvailable GiB |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        where = "optimizer + params on NVMe" if r["offload"] else ("in memory, capped" if r["capped"] else "in memory")
        trained = "yes" if r["trained"] else f"no: {r['error']}" if r["error"] else "no"
        out.append(
            f"| {r['layers']} x {r['width']} | {r['params'] / 1e9:.2f}B | {r['state_bytes'] / r['machine_bytes']:.2f}x "
            f"| {where} | {trained} | {' → '.join(f'{x:.3f}' for x in r['losses'])} | {r['build_s']:.0f} "
            f"| {' / '.join(f'{x:.0f}' for x in r['step_s'])} "
            f"| {max(r['peak_rss'], default=0) / GIB:.2f} | {max(r['nvme'], default=0) / GIB:.2f} "
            f"| {r['read_bytes'] / GIB:.1f} / {r['written_bytes'] / GIB:.1f} | {r['lowest_available'] / GIB:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=46)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--offload", action="store_true", help="optimizer state and parameters on NVMe under --path")
    ap.add_argument("--path", default="/var/tmp/zero_ray_offload")
    ap.add_argument("--cap", action="store_true",
                    help="cap each owner at a quarter of the machine's memory less 3 GiB")
    ap.add_argument("--results-dir", default="benchmarks/results")
    args = ap.parse_args()
    if args.cap and args.offload:
        ap.error("--cap counts address space, which the offloaded state's mapped files are: use one or the other")
    info = machine_info() | {"loadavg_start": loadavg()}
    ray.init(num_cpus=OWNERS + 2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env())
    try:
        row = run(args)
    finally:
        ray.shutdown()
    info["loadavg_end"] = loadavg()
    path = os.path.join(args.results_dir, "offload_capacity.json")
    rows: list[dict[str, Any]] = []
    if os.path.exists(path):  # one row per run: the runs so far are kept
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)["runs"]
    rows.append(asdict(row) | {"machine": machine_line(info), "command": " ".join(sys.argv[1:])})
    sources = "\n".join(f"- {r['layers']} x {r['width']}: {r['machine']}; `{r['command']}`" for r in rows)
    write_results(args.results_dir, "offload_capacity", {"runs": rows}, table(rows) + "\n\n" + sources)


if __name__ == "__main__":
    main()
