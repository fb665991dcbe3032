"""``python -m benchmarks.gpu_check``: the GPU path on a machine with one or more GPUs.

Runs the ``gpu`` tests (tests/gpu), then a throughput run: a GPT of about 1B parameters, bf16,
ZeRO stage 3 (each transformer block a unit), world size = the GPU count. It reports tokens/s,
model-FLOPs utilisation against the device's bf16 peak (benchmarks.harness.gpu), and each rank's
peak allocated memory against the paper's 16Ψ/N plus the gathered/reduce buffers plus the
activations, measured beforehand in this process as a plain bf16 forward and backward's peak
less its parameters and gradients. Writes benchmarks/results/gpu.{json,md}. Meant to finish in
under 8 minutes; exits 2 without touching the results where no GPU is visible.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def run_gpu_tests(timeout_s: float) -> dict[str, Any]:
    """pytest -m gpu tests/gpu in a subprocess (its own Ray); counts from its JUnit XML."""
    from benchmarks.harness.gpu import summarize_junit

    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "gpu.xml")
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                   "tests/gpu", f"--junitxml={xml}"], cwd=REPO, timeout=timeout_s,
                                  capture_output=True, text=True, check=False)
            tail = (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired:
            return {"passed": 0, "failed": 0, "skipped": 0, "failures": [f"timed out after {timeout_s:g}s"],
                    "seconds": timeout_s, "output": ""}
        cases = []
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                           else "skipped" if case.find("skipped") is not None else "passed")
                cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
        out = summarize_junit(cases)
        out.update(seconds=time.perf_counter() - start, output=tail, returncode=proc.returncode)
        return out


def gpt_config(args: argparse.Namespace) -> Any:
    from zero_ray.models import GPTConfig

    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.width, tie_embeddings=True)


def measure_activations(cfg: Any, micro_batch: int) -> int:
    """Peak bytes of a plain bf16 forward and backward on one micro-batch, less its parameters
    and gradients: what activations (and autograd's temporaries) add to a step's peak."""
    from zero_ray.models import GPT, lm_loss

    torch.manual_seed(0)
    model = GPT(cfg).to(device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size + 1), device="cuda")
    lm_loss(model, tokens).backward()  # the first pass allocates cuBLAS workspaces and the grads
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()  # parameters, gradients, workspaces
    torch.cuda.reset_peak_memory_stats()
    lm_loss(model, tokens).backward()
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - held
    del model, tokens
    gc.collect()
    torch.cuda.empty_cache()
    return activations


def run_throughput(args: argparse.Namespace, gpus: int, activations: int) -> dict[str, Any]:
    import ray

    import zero_ray as zr
    from benchmarks.harness.gpu import MemoryCheck, bf16_peak, flops_per_token, mfu
    from zero_ray.config import Stage3Config
    from zero_ray.core.memory_formulas import model_state_bytes
    from zero_ray.models import GPT, Block, lm_loss

    cfg = gpt_config(args)
    num_params = sum(p.numel() for p in GPT(cfg).parameters()) if args.count_params else _gpt_params(cfg)
    ray.init(include_dashboard=False, log_to_driver=False)
    config = zr.ZeroConfig(stage=3, world_size=gpus, device="cuda", dtype="bfloat16",
                           stage3=Stage3Config(wrap_policy=(Block,)), init_timeout_s=600, step_timeout_s=600)
    trainer = zr.ZeroTrainer(functools.partial(GPT, cfg), lm_loss, optimizer=zr.AdamW(lr=1e-4), config=config)
    try:
        g = torch.Generator().manual_seed(0)
        batch = torch.randint(0, cfg.vocab_size, (args.micro_batch * gpus, cfg.block_size + 1), generator=g)
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            trainer.step(batch)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        reports = trainer.memory_report()
    finally:
        trainer.shutdown()
        ray.shutdown()
    step_s = statistics.median(times)
    tokens = args.micro_batch * gpus * cfg.block_size
    peak = bf16_peak(torch.cuda.get_device_name(0))
    per_token = flops_per_token(num_params=num_params, n_layer=cfg.n_layer, n_embd=cfg.n_embd, seq_len=cfg.block_size)
    state = model_state_bytes(stage=3, num_params=num_params, world_size=gpus).total
    memory = []
    for r in reports:
        check = MemoryCheck(measured=r["cuda_peak_allocated"], model_state=state,
                            buffers=r["gather_buffers"] + r["reduce_buffers"], activations=activations)
        memory.append({"rank": r["rank"], "measured": check.measured, "model_state": state, "buffers": check.buffers,
                       "activations": activations, "expected": check.expected, "deviation": check.deviation,
                       "within": check.within, "fragmentation": r["cuda_fragmentation"],
                       "reserved_peak": r["cuda_peak_reserved"]})
    return {"num_params": num_params, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "seq_len": cfg.block_size,
            "world_size": gpus, "micro_batch": args.micro_batch, "tokens_per_step": tokens, "steps": args.steps,
            "warmup": args.warmup, "step_s": step_s, "step_times": times, "tokens_per_s": tokens / step_s,
            "flops_per_token": per_token, "peak_flops": peak,
            "mfu": None if peak is None else mfu(tokens_per_s=tokens / step_s, flops_per_token=per_token,
                                                  peak_flops=peak, devices=gpus),
            "memory": memory}


def _gpt_params(cfg: Any) -> int:
    """zero_ray.models.GPT's parameter count (tied head), without building it."""
    h, layers = cfg.n_embd, cfg.n_layer
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    return cfg.vocab_size * h + cfg.block_size * h + layers * block + 2 * h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tests-timeout", type=float, default=240.0)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--count-params", action="store_true", help="build the model on the host to count parameters")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device here; nothing run, nothing written")
        return 2
    from benchmarks.harness.gpu import MFU_TARGET, markdown

    gpus = torch.cuda.device_count()
    result: dict[str, Any] = {
        "command": "python -m " + "benchmarks.gpu_check " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
        "cuda": torch.version.cuda, "notes": [],
    }
    start = time.perf_counter()
    result["tests"] = {"skipped_by_flag": True} if args.skip_tests else run_gpu_tests(args.tests_timeout)
    cfg = gpt_config(args)
    result["activations_bytes"] = measure_activations(cfg, args.micro_batch)
    result["throughput"] = run_throughput(args, gpus, result["activations_bytes"])
    result["seconds"] = time.perf_counter() - start
    run = result["throughput"]
    if run["mfu"] is not None and gpus == 1 and run["mfu"] < MFU_TARGET:
        result["notes"].append(f"MFU {100 * run['mfu']:.1f}% is below the {100 * MFU_TARGET:.0f}% target.")
    if not all(m["within"] for m in run["memory"]):
        result["notes"].append("Peak memory is outside 5% of formula + buffers + activations on some rank.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "gpu.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if result["tests"].get("failed", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
