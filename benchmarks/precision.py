"""``python -m benchmarks.precision``: how far bf16 compute moves the main job's loss from fp32,
with gradients reduced in bf16 and in fp32 (``ZeroConfig(reduce_dtype="float32")``).

The main job's GPT, data, order, AdamW and WarmupCosine schedule (``zero_ray.demo``), stage 2 on
two owners, ``--steps`` steps each for fp32, bf16 and bf16 with fp32 reduction; prints a table of
the per-step training-loss deviation from the fp32 run (max and mean absolute over the steps, and
at the last step) and the held-out loss, and writes ``benchmarks/results/precision.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import ray
import torch

import zero_ray as zr
from zero_ray.demo import CorpusWindows, stdlib_corpus
from zero_ray.models import GPT, GPTConfig, lm_loss_sum

RUNS = (("fp32", "float32", None), ("bf16", "bfloat16", None), ("bf16 + fp32 reduce", "bfloat16", "float32"))


def run(dtype: str, reduce_dtype: str | None, args: argparse.Namespace) -> dict[str, Any]:
    gpt = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=4, n_head=4, n_embd=128)
    train, held_out = CorpusWindows(stdlib_corpus(4 * 2**20), args.block_size).split(0.05)
    config = zr.ZeroConfig(stage=2, world_size=2, dtype=dtype, reduce_dtype=reduce_dtype, max_grad_norm=1.0)
    schedule = zr.WarmupCosine(warmup_steps=max(1, args.steps // 20), total_steps=args.steps, min_ratio=0.1)
    losses: list[float] = []
    start = time.perf_counter()
    with zr.ZeroTrainer(functools.partial(GPT, gpt), lm_loss_sum, optimizer=zr.AdamW(lr=3e-3, weight_decay=0.1),
                        lr_scheduler=schedule, config=config) as trainer:
        trainer.fit(train, global_batch_size=args.batch_size, steps=args.steps, progress=False,
                    callback=lambda m: losses.append(float(m["loss"])))
        held = trainer.evaluate(_first(held_out, args.batch_size * 4))
    return {"losses": losses, "eval_loss": float(held["loss"]), "seconds": time.perf_counter() - start}


def _first(dataset: CorpusWindows, n: int) -> torch.Tensor:
    """The first ``n`` held-out windows as one batch (the same for every run)."""
    return torch.stack([dataset[i] for i in range(min(n, len(dataset)))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--output-dir", default=os.path.join("benchmarks", "results"))
    args = ap.parse_args()
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    results = {name: run(dtype, reduce, args) for name, dtype, reduce in RUNS}
    base = results["fp32"]["losses"]
    rows = []
    for name, _, _ in RUNS:
        losses = results[name]["losses"]
        dev = [abs(a - b) for a, b in zip(losses, base)]
        rows.append({"run": name, "final_loss": losses[-1], "eval_loss": results[name]["eval_loss"],
                     "max_abs_dev": max(dev), "mean_abs_dev": sum(dev) / len(dev), "final_abs_dev": dev[-1],
                     "seconds": results[name]["seconds"]})
    lines = [f"{args.steps} steps of the main job's GPT (stage 2, 2 owners, global batch {args.batch_size} x "
             f"{args.block_size} tokens); training-loss deviation from the fp32 run:", "",
             "| run | final loss | held-out loss | max abs dev | mean abs dev | final abs dev | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['run']} | {r['final_loss']:.4f} | {r['eval_loss']:.4f} | {r['max_abs_dev']:.4f} | "
              f"{r['mean_abs_dev']:.4f} | {r['final_abs_dev']:.4f} | {r['seconds']:.0f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "precision.json"), "w", encoding="utf-8") as fh:
        json.dump({"steps": args.steps, "rows": rows, "losses": {k: v["losses"] for k, v in results.items()}}, fh,
                  indent=1)
    with open(os.path.join(args.output_dir, "precision.md"), "w", encoding="utf-8") as fh:
        fh.write(table + "\n")


if __name__ == "__main__":
    main()
