"""Run by test_multinode.py inside the head node's namespace of a simulated 2-node cluster:
stage 3 with shard groups of a node and hpZ, against the single process. After three steps
(the third's cross-node bytes counted by comm_report and by the kernel) the other node is lost
at once (every process in its namespace SIGKILLed: its raylet and its owners), and the run goes
on on the head node's group, restored from its own live state. Prints one JSON line: the
deviation after all steps, the bytes, the time the step after the loss took and the recovery."""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import ray
import torch

import zero_ray as zr
from benchmarks.harness.simcluster import cross_node_bytes, kill_node
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process


def main() -> None:
    namespaces, other_node = sys.argv[1].split(","), sys.argv[2]

    fn = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (8, 17), generator=g) for _ in range(5)]
    opt = zr.AdamW(lr=1e-3)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    cfg = zr.ZeroConfig(stage=3, world_size=4, device="cpu", bucket_bytes=1 << 16, health_timeout_s=5.0,
                        topology=zr.Topology(shard_group_size="node", secondary_group_size="node"),
                        stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)))
    with zr.ZeroTrainer(fn, lm_loss, optimizer=opt, config=cfg) as trainer:
        for b in batches[:2]:
            trainer.step(b)
        before = cross_node_bytes(namespaces)
        trainer.step(batches[2])
        after = cross_node_bytes(namespaces)
        comm = trainer.comm_report()
        nodes = [r["node_id"] for r in ray.get([a.node.remote() for a in trainer._pool.actors])]
        head = ray.get_runtime_context().get_node_id()
        on_other = [r for r, n in enumerate(nodes) if n != head]
        killed = kill_node(other_node)
        t0 = time.perf_counter()
        trainer.step(batches[3])
        next_step_s = time.perf_counter() - t0
        trainer.step(batches[4])
        memory = trainer.memory_report()
        got = trainer.full_state_dict()
        recoveries = [(r.outcome.value, r.source, sorted(r.lost), r.world_size_after) for r in trainer.recoveries]
        summaries = [r.summary() for r in trainer.recoveries]
    ray.shutdown()
    ref, _ = single_process(fn, lm_loss, opt, batches)
    print(json.dumps({"dev": max(float((got[k] - ref[k]).abs().max()) for k in ref), "nodes": nodes,
                      "iface": after - before, "comm_cross": sum(c["cross_node"] for c in comm),
                      "comm_inside": sum(c["inside_node"] for c in comm),
                      "across": sum(c.get("reduce_scatter_across", 0) for c in comm),
                      "killed": len(killed), "on_other": on_other, "next_step_s": next_step_s, "recoveries": recoveries,
                      "summaries": summaries, "secondary": [m["params_secondary"] for m in memory],
                      "health_timeout_s": cfg.health_timeout_s}))


if __name__ == "__main__":
    main()
