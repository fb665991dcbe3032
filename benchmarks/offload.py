"""What keeping the optimizer state on local disk saves an owner, and what it costs a step.

    python -m benchmarks.offload [--layers 12 --width 768] [--steps 5] [--path /var/tmp]

Two trials, each a fresh Python process with one owner (world size 1, stage 1, AdamW, fp32):
``memory`` keeps the optimizer state in memory, ``nvme`` passes
``Offload(optimizer="nvme", path=...)``. The model is Hugging Face GPT-2 built from a config
(12 layers of 768 by default: 124M parameters). Each trial reports the owner's peak resident
set (``VmHWM``) over the whole run and over the steps after the first (the peak is reset after
the first step, through ``/proc/self/clear_refs``: the first step is where torch creates the
state), the memory report's optimizer and ``nvme`` bytes, the streaming window (the most state
resident at once: a group's and the next one's, read ahead), step times, and a hash of the final fp32 parameters, equal in both
trials when the runs are bit for bit the same. A second table breaks the steps after the first
down (medians): forward and backward, the update, and within a streamed update
(``owner/step/state_stream.StreamTimes``) what the stepping thread spent waiting for a group's state,
stepping, and waiting at the end for the last groups to be put back, against what the helper
thread spent meanwhile reading the state in, checking its checksums, recording new ones and
handing the pages back (its time overlaps the steps: the less the stepping thread waits, the
more of it is hidden); with the bytes the process read from and wrote to the disk per step
(``/proc/self/io``; writes are the kernel's write-back, so they land after the step that dirtied
them and overlap the next one).

With ``--cold``, a third trial, ``nvme-cold``, writes the state files back and drops their pages
from the page cache after every step (``fdatasync`` and ``POSIX_FADV_DONTNEED`` on each, outside
the timed step; root, for ``/proc/self/map_files``), so that every step reads its state from the
disk: a model whose state does not fit in the page cache. Its write-back is left out of the step.

Writes ``benchmarks/results/offload.{json,md}`` (``--results-dir``) and prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness.report import machine_line
from benchmarks.harness.runner import loadavg, machine_info
from benchmarks.harness.trials import add_trial_arguments, run_child, write_results

TRIALS = ("memory", "nvme")
COLD = "nvme-cold"
MIB = 2**20


def _page_out_state() -> int:
    """Write this process's offloaded state files back and drop them from the page cache, so
    the next step reads them from the disk; returns their bytes. The files are unlinked: each is
    opened through ``/proc/self/map_files`` (root), written back (``fdatasync``) and dropped
    (``POSIX_FADV_DONTNEED``; the owner has already unmapped their pages after the update)."""
    total = 0
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        for line in f:
            if "zero_ray-rank" not in line or "(deleted)" not in line:
                continue
            span = line.split()[0]
            fd = os.open(f"/proc/self/map_files/{span}", os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


@dataclass(frozen=True, kw_only=True)
class OffloadRow:
    """One trial's figures (bytes and seconds)."""

    trial: str
    params: int
    optimizer_bytes: int  # master + moments, the memory report's ``optimizer``
    nvme_bytes: int
    window_bytes: int  # the most optimizer state streaming holds at once: a group's and the next one's
    peak_rss_bytes: int  # over the whole run, construction included
    steady_peak_rss_bytes: int  # over the steps after the first
    first_step_s: float
    steady_step_s: float  # median of the steps after the first
    params_sha256: str
    # The steps after the first, medians: forward and backward; the update (the step less those);
    # the streamed update's parts (owner/step/state_stream.StreamTimes; 0 in memory); disk bytes per step.
    compute_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0
    optimizer_s: float = 0.0
    drain_s: float = 0.0
    read_s: float = 0.0
    verify_s: float = 0.0
    seal_s: float = 0.0
    evict_s: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux 4.0+)


def _disk_io() -> tuple[int, int]:
    """Bytes this process has made the kernel read from and write to storage."""
    with open("/proc/self/io", encoding="ascii") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _child(args: argparse.Namespace, nvme: bool, *, cold: bool = False) -> OffloadRow:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_ray as zr
    from zero_ray.collective.collective_api import SoloGroup
    from zero_ray.core.optimizer_plan import check_optimizer_factories
    from zero_ray.core.precision import parse_dtype
    from zero_ray.core.stages import stage_plan
    from zero_ray.owner.step.engine import OwnerEngine
    from zero_ray.owner.step.run_spec import EngineSpec

    torch.set_num_threads(1)  # as a one-CPU owner
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=max(1, args.width // 64), use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)

    def model_fn() -> torch.nn.Module:
        return GPT2LMHeadModel(config)

    def loss_fn(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return module(input_ids=tokens, labels=tokens).loss

    offload = zr.Offload(optimizer="nvme", path=args.path) if nvme else zr.Offload()
    spec = EngineSpec(model_fn=model_fn, loss_fn=loss_fn, optimizers=check_optimizer_factories(zr.AdamW(lr=1e-4)),
                      plan=stage_plan(1), compute_dtype=parse_dtype("float32"), device="cpu", seed=0,
                      bucket_bytes=args.bucket_mib * MIB, grad_accum_steps=1, max_grad_norm=None,
                      loss_scale=zr.LossScaleConfig(), offload=offload)
    engine = OwnerEngine(spec, rank=0, group=SoloGroup())
    g = torch.Generator().manual_seed(0)
    took: list[float] = []
    parts: list[tuple[float, ...]] = []  # as _PARTS
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        io = _disk_io()
        start = time.perf_counter()
        result = engine.step(tokens, global_samples=args.batch)
        took.append(time.perf_counter() - start)
        read, written = (b - a for a, b in zip(io, _disk_io()))
        t = engine.state.optimizer.stream.times
        parts.append((result.compute_seconds, took[-1] - result.compute_seconds, t.wait_s, t.step_s, t.drain_s,
                      t.read_s, t.verify_s, t.seal_s, t.evict_s, read, written))
        if step == 0:
            peak = _peak_rss()
            _reset_peak_rss()
        if cold and _page_out_state() == 0:
            raise RuntimeError("--page-out found no offloaded state file mapped in this process")
    steady_peak = _peak_rss()
    report = engine.memory_report()
    # At most two groups' state is resident while streaming: the one stepping and the next, read ahead.
    held = [4 * len(g_.moments) * g_.update_numel for g_ in engine.state.groups if g_.moments]
    window = max((a + b for a, b in zip(held, held[1:])), default=sum(held))
    digest = hashlib.sha256()
    for name, (_, _, values) in sorted(engine.master_fragments().items()):
        digest.update(name.encode())
        digest.update(values.numpy().tobytes())
    return OffloadRow(trial="", params=sum(p.numel for p in engine.layout.params),
                      optimizer_bytes=report["optimizer"], nvme_bytes=report["nvme"], window_bytes=window,
                      peak_rss_bytes=max(peak, steady_peak), steady_peak_rss_bytes=steady_peak,
                      first_step_s=took[0], steady_step_s=statistics.median(took[1:]),
                      params_sha256=digest.hexdigest(), **_medians(parts[1:]))


_PARTS = ("compute_s", "update_s", "wait_s", "optimizer_s", "drain_s", "read_s", "verify_s", "seal_s", "evict_s",
          "read_bytes", "write_bytes")


def _medians(parts: list[tuple[float, ...]]) -> dict[str, Any]:
    values = {n: statistics.median(column) for n, column in zip(_PARTS, zip(*parts))}
    return {n: int(v) if n.endswith("_bytes") else float(v) for n, v in values.items()}


def _trial(name: str, args: argparse.Namespace) -> OffloadRow:
    data = run_child("benchmarks.offload", ["--layers", str(args.layers), "--width", str(args.width), "--vocab",
                                            str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
                                            "--steps", str(args.steps), "--bucket-mib", str(args.bucket_mib),
                                            "--path", args.path] + (["--nvme"] if name != "memory" else [])
                     + (["--page-out"] if name == COLD else []),
                     name=name, timeout_s=args.timeout)
    return OffloadRow(**{**data, "trial": name})


def render(rows: list[OffloadRow], *, command: str, machine: str) -> str:
    memory = next(r for r in rows if r.trial == "memory")
    lines = [f"Optimizer state on local disk (`{command}`), one owner, one thread; {machine}", "",
             "| trial | parameters | optimizer state | on NVMe | window | peak RSS | steady peak RSS | "
             "saved (steady) | first step (s) | steady step (s) | × memory | same bits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        saved = memory.steady_peak_rss_bytes - r.steady_peak_rss_bytes
        lines.append(f"| {r.trial} | {r.params / 1e6:.1f}M | {r.optimizer_bytes / MIB:.0f} MiB | "
                     f"{r.nvme_bytes / MIB:.0f} MiB | {r.window_bytes / MIB:.0f} MiB | "
                     f"{r.peak_rss_bytes / MIB:.0f} MiB | {r.steady_peak_rss_bytes / MIB:.0f} MiB | "
                     f"{saved / MIB:.0f} MiB | {r.first_step_s:.2f} | {r.steady_step_s:.2f} | "
                     f"{r.steady_step_s / memory.steady_step_s:.2f} | "
                     f"{'yes' if r.params_sha256 == memory.params_sha256 else 'NO'} |")
    lines += ["", "Where a step after the first goes (medians, seconds; the update is the step less forward and "
                  "backward; the helper thread's columns overlap the stepping thread's; read and written: the disk, "
                  "per step)", "",
              "| trial | step | forward + backward | update | waiting for state | optimizer step | final put-back | "
              "helper: read in | helper: check | helper: new checksums | helper: hand back | read | written |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.trial} | {r.steady_step_s:.2f} | {r.compute_s:.2f} | {r.update_s:.2f} | {r.wait_s:.3f} | "
                     f"{r.optimizer_s:.3f} | {r.drain_s:.3f} | {r.read_s:.3f} | {r.verify_s:.3f} | {r.seal_s:.3f} | "
                     f"{r.evict_s:.3f} | {r.read_bytes / MIB:.0f} MiB | {r.write_bytes / MIB:.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="at least 2 (the first creates the state)")
    parser.add_argument("--bucket-mib", type=int, default=25, help="ZeroConfig.bucket_bytes in MiB (a group's size)")
    parser.add_argument("--path", default="/var/tmp", help="Offload(path=...): a directory on local disk")
    add_trial_arguments(parser, timeout_s=1800.0)
    parser.add_argument("--cold", action="store_true",
                        help=f"a third trial, {COLD}: every step reads the state from the disk, not the page cache")
    parser.add_argument("--nvme", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--page-out", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: at least 2 (the first creates the optimizer state)")
    if args.child:
        print(json.dumps(asdict(_child(args, args.nvme, cold=args.page_out))))
        return 0
    info: dict[str, Any] = machine_info()
    rows = [_trial(name, args) for name in TRIALS + ((COLD,) if args.cold else ())]
    info["loadavg_end"] = loadavg()
    command = "python -m benchmarks.offload " + " ".join(argv if argv is not None else sys.argv[1:])
    table = render(rows, command=command.strip(), machine=machine_line(info))
    write_results(args.results_dir, "offload", {"args": {k: v for k, v in vars(args).items()
                                                         if k not in ("child", "nvme", "page_out")},
                                                "machine": info, "rows": [asdict(r) for r in rows]}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
