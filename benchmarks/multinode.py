"""Multi-node topologies on a simulated cluster: flat stage 3, shard groups, hpZ and ZeRO++.

    sudo python -m benchmarks.multinode --nodes 2 --owners-per-node 2 --link-mbit 1000 --delay-ms 0.5 [--json OUT]

Builds ``--nodes`` Ray nodes on this machine, each in its own network namespace, whose uplinks
``tc`` shapes to ``--link-mbit`` and that are delayed by ``--delay-ms`` (netem, or where the
kernel has none, a user-space delay line: benchmarks/harness/simcluster.py). Each
configuration trains the same model (a GPT with many parameters for its compute, 12.7M by
default, so that two shared cores are bound by the link rather than by arithmetic) on the same
learnable batches from the same seed, in a driver inside the head node's namespace:

- flat: stage 3 over every owner (today's ZeRO);
- shard-groups: stage 3 partitioned within each node, replicated across nodes (HSDP / MiCS);
- hpz: flat stage 3 plus a secondary partition per node, so backward's gather stays in the node;
- zero++: hpz with int8 forward gathers (qwZ) and int4 (``--zpp-grad int8``: int8) gradients
  across nodes (qgZ).

Per configuration: step time (median of the timed steps), cross-node bytes per step from the
kernel's interface counters (everything nodes sent each other, Ray's own traffic included) and
from ``comm_report()`` (the owners' collectives, summed over owners), memory per owner and the
loss after the run. Writes ``benchmarks/results/multinode.{json,md}`` (or ``--json OUT``).
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

CONFIGS = ("flat", "shard-groups", "hpz", "zero++")
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def topology_of(name: str, *, zpp_grad: str = "int4") -> Any:
    import zero_ray as zr

    return {"flat": zr.Topology(),
            "shard-groups": zr.Topology(shard_group_size="node"),
            "hpz": zr.Topology(secondary_group_size="node"),
            "zero++": zr.Topology(secondary_group_size="node", weight_comm="int8", grad_comm=zpp_grad)}[name]


def learnable_batches(*, steps: int, batch: int, length: int, vocab: int, seed: int) -> list[Any]:
    """Token sequences a model can learn: arithmetic progressions mod ``vocab`` with a random start
    and a step from 1-3 (the next token is determined after two)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        out.append((start + step * torch.arange(length)) % vocab)
    return out


# -- one configuration, run as a driver inside the head node's namespace ---------------------------
def run_config(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    import zero_ray as zr
    from benchmarks.harness.simcluster import cross_node_bytes
    from zero_ray.models import GPT, GPTConfig, lm_loss

    world = args.nodes * args.owners_per_node
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_head=4,
                    n_embd=args.n_embd)
    batches = learnable_batches(steps=args.warmup + args.steps, batch=args.batch_per_owner * world,
                                length=cfg.block_size + 1, vocab=cfg.vocab_size, seed=args.seed)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    namespaces = args.namespaces.split(",")

    config = zr.ZeroConfig(stage=3, world_size=world, device="cpu", seed=args.seed, topology=topology_of(
        args.config, zpp_grad=args.zpp_grad), collective_timeout_s=120.0, step_timeout_s=600.0, init_timeout_s=180.0)
    times, losses = [], []
    with zr.ZeroTrainer(lambda: GPT(cfg), lm_loss, optimizer=zr.AdamW(lr=args.lr), config=config) as trainer:
        for b in batches[:args.warmup]:
            losses.append(trainer.step(b)["loss"])
        before = cross_node_bytes(namespaces)
        for b in batches[args.warmup:]:
            t0 = time.perf_counter()
            losses.append(trainer.step(b)["loss"])
            times.append(time.perf_counter() - t0)
        after = cross_node_bytes(namespaces)
        comm, memory = trainer.comm_report(), trainer.memory_report()
    ray.shutdown()
    return {"config": args.config, "step_s": statistics.median(times), "step_s_all": times,
            "cross_node_bytes_per_step": (after - before) / len(times),
            "comm_report_cross_node_bytes_per_step": sum(c["cross_node"] for c in comm),
            "comm_report_inside_node_bytes_per_step": sum(c["inside_node"] for c in comm),
            "comm_report_total_bytes_per_step": sum(c["total"] for c in comm),
            "memory_per_owner_bytes": max(m["total"] for m in memory),
            "params_secondary_bytes": max(m.get("params_secondary", 0) for m in memory),
            "loss_first": losses[0], "loss_last": losses[-1], "steps": len(times), "warmup": args.warmup,
            "numel": memory[0]["numel"]}


# -- the orchestrator ----------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], header: str) -> str:
    flat = next((r for r in rows if r["config"] == "flat"), None)
    lines = [header, "",
             "| config | step s | vs flat | cross-node B/step (iface) | vs flat | cross-node B/step (comm_report) "
             "| inside-node B/step (comm_report) | memory/owner B | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = f"{flat['step_s'] / r['step_s']:.2f}x" if flat else "-"
        cross = f"{r['cross_node_bytes_per_step'] / flat['cross_node_bytes_per_step']:.3f}x" if flat else "-"
        lines.append(f"| {r['config']} | {r['step_s']:.3f} | {speed} | {r['cross_node_bytes_per_step']:,.0f} | {cross} "
                     f"| {r['comm_report_cross_node_bytes_per_step']:,} | {r['comm_report_inside_node_bytes_per_step']:,} "
                     f"| {r['memory_per_owner_bytes']:,} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multinode", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--owners-per-node", type=int, default=2)
    p.add_argument("--link-mbit", type=float, default=1000.0)
    p.add_argument("--delay-ms", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-per-owner", type=int, default=1)
    # A GPT whose parameters are many for its compute, so that a 2-core machine is bound by the
    # link, not by arithmetic: 12.7M parameters, 32 tokens a sequence.
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zpp-grad", choices=("int4", "int8"), default="int4")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--json", default=None, help="write the JSON here (default: benchmarks/results/multinode.json)")
    p.add_argument("--config", help=argparse.SUPPRESS)  # worker mode: one configuration, in the head namespace
    p.add_argument("--namespaces", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.config:
        print("ROW " + json.dumps(run_config(args)), flush=True)
        return 0
    from benchmarks.harness.simcluster import SimCluster, available

    why = available()
    if why is not None:
        print(f"benchmarks.multinode: cannot build the simulated cluster: {why}", file=sys.stderr)
        return 2
    rows = []
    load = os.getloadavg()
    with SimCluster(nodes=args.nodes, cpus_per_node=args.owners_per_node, link_mbit=args.link_mbit,
                    delay_ms=args.delay_ms) as cluster:
        namespaces = ",".join(n.namespace for n in cluster.members)
        link = cluster.link
        for name in args.configs.split(","):
            argv_ = [sys.executable, "-m", "benchmarks.multinode", "--config", name, "--namespaces", namespaces,
                     *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k in ("nodes", "owners_per_node", "steps", "warmup", "batch_per_owner", "lr", "seed",
                                "zpp_grad", "n_embd", "n_layer", "block_size", "vocab"))]
            got = cluster.run_in_head(argv_, timeout_s=1800, cwd=str(REPO))
            row = next((json.loads(line[4:]) for line in got.stdout.splitlines() if line.startswith("ROW ")), None)
            if row is None:
                raise RuntimeError(f"configuration {name} failed ({got.returncode}):\n{got.stderr[-4000:]}")
            rows.append(row)
            print(f"{name}: step {row['step_s']:.3f}s, cross-node {row['cross_node_bytes_per_step']:,.0f} B/step "
                  f"(comm_report {row['comm_report_cross_node_bytes_per_step']:,}), loss {row['loss_last']:.3f}",
                  flush=True)
    header = (f"Simulated cluster: {args.nodes} nodes x {args.owners_per_node} owners (network namespaces, "
              f"links: {link}), stage 3, GPT "
              f"{args.n_layer} x {args.n_embd}, ctx {args.block_size}, vocab {args.vocab} ({rows[0]['numel']:,} "
              f"parameters, fp32), batch {args.batch_per_owner}/owner, {args.steps} timed steps "
              f"after {args.warmup}; load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
              f"on {os.cpu_count()} cores")
    text = table(rows, header)
    print(text)
    out = Path(args.json) if args.json else RESULTS / "multinode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k not in ("config", "namespaces", "json")}
    out.write_text(json.dumps({"rows": rows, "args": meta, "load_start": load[0], "load_end": os.getloadavg()[0],
                               "link": link},
                              indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
