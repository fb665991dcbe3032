"""Quantized communication against fp32: the loss of the main job's GPT after N steps.

    python -m benchmarks.quantized_loss [--steps 300] [--world-size 4] [--json OUT]

Trains the main job's GPT (examples/train_gpt.py: vocab 256, 4 layers, 4 heads, embedding 128,
on the Python standard library's sources) at stage 3 on ``--world-size`` owners of one node,
from the same seed on the same batches, with flat fp32 ZeRO and with ZeRO++'s quantized
collectives: hpZ with int8 forward gathers (qwZ) and int8 or int4 gradients (qgZ). On one node
the inner groups of ``--group`` owners stand in for nodes: the gradients are reduced in full
precision inside them and quantized across them, as across nodes. Reports the mean loss of the
last ``--tail`` steps per configuration and its difference from fp32; writes
``benchmarks/results/quantized_loss.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def configs(group: int) -> dict[str, Any]:
    import zero_ray as zr

    return {"fp32 flat": zr.Topology(),
            "zero++ int8 grads": zr.Topology(secondary_group_size=group, weight_comm="int8", grad_comm="int8"),
            "zero++ int4 grads": zr.Topology(secondary_group_size=group, weight_comm="int8", grad_comm="int4")}


def run(name: str, topology: Any, args: argparse.Namespace, batches: list[Any]) -> dict[str, Any]:
    import zero_ray as zr
    from zero_ray.models import GPT, GPTConfig, lm_loss

    gpt = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=4, n_head=4, n_embd=128)
    config = zr.ZeroConfig(stage=3, world_size=args.world_size, device="cpu", seed=args.seed, max_grad_norm=1.0,
                           topology=topology)
    losses = []
    t0 = time.perf_counter()
    with zr.ZeroTrainer(lambda: GPT(gpt), lm_loss, optimizer=zr.AdamW(lr=args.lr), config=config) as trainer:
        for b in batches:
            losses.append(trainer.step(b)["loss"])
    tail = statistics.fmean(losses[-args.tail:])
    return {"config": name, "losses": losses, "tail_mean": tail, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantized_loss", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--group", type=int, default=2, help="owners per simulated node (the inner group)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import ray
    import torch

    from zero_ray.demo import stdlib_corpus

    corpus = stdlib_corpus()
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, corpus.numel() - args.block_size - 1, (args.steps, args.batch_size), generator=g)
    batches = [torch.stack([corpus[s:s + args.block_size + 1] for s in row.tolist()]).long() for row in starts]
    load = os.getloadavg()[0]
    ray.init(address="local", num_cpus=args.world_size + 1, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for name, topology in configs(args.group).items():
            rows.append(run(name, topology, args, batches))
            print(f"{name}: last-{args.tail} mean loss {rows[-1]['tail_mean']:.4f} ({rows[-1]['seconds']:.0f} s)",
                  flush=True)
    finally:
        ray.shutdown()
    base = rows[0]["tail_mean"]
    lines = [f"Main job's GPT (vocab 256, 4 x 128, ctx {args.block_size}), stage 3, {args.world_size} owners on one "
             f"node with inner groups of {args.group}, batch {args.batch_size}, AdamW lr {args.lr}, {args.steps} "
             f"steps, same seed and batches; load average {load:.2f} at start on {os.cpu_count()} cores", "",
             f"| config | loss at step 1 | mean loss, last {args.tail} steps | vs fp32 flat |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['losses'][0]:.4f} | {r['tail_mean']:.4f} | {r['tail_mean'] - base:+.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.json) if args.json else RESULTS / "quantized_loss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args), "load_start": load}, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
