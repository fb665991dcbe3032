"""Run by test_elastic_cluster.py in its own process: a multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``) loses a worker node mid-run and later gains one back; it steps
until the run is back at its size, bounded in time (not in steps: a fast machine runs any
number of steps while a replacement owner starts), and reports how long the grow-back took.

Prints one JSON line with the outcome; the parent test asserts on it.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import ray
import torch
from ray.cluster_utils import Cluster

import zero_ray as zr
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process


def main() -> None:
    stage = int(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    fn = functools.partial(mlp, 16, 3)
    g = torch.Generator().manual_seed(21)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    opt = zr.SGD(lr=0.05, momentum=0.9)
    cfg = zr.ZeroConfig(stage=stage, world_size=4, bucket_bytes=4096, placement_strategy="SPREAD",
                        health_interval_s=0.5, health_timeout_s=5.0, collective_timeout_s=20.0,
                        elastic=zr.ElasticConfig(redundancy="peer", min_world_size=2, grow_check_s=0.0),
                        stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)) if stage == 3 else zr.Stage3Config())
    trainer = zr.ZeroTrainer(fn, mse_loss, optimizer=opt, config=cfg)
    sizes: list[int] = []
    joined = deadline = grow_back_s = None
    try:
        i = 0
        while deadline is None or time.monotonic() < deadline:
            if i == 3:
                cluster.remove_node(workers[0])  # a whole node (two owners, say) goes away between steps
            if i == 5:
                workers.append(cluster.add_node(num_cpus=2))  # a replacement node joins
                cluster.wait_for_nodes()
                joined = time.monotonic()
                deadline = joined + 180
            batches.append((torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)))
            trainer.step(batches[-1])
            sizes.append(trainer.world_size)
            i += 1
            # Replacements join at the first step boundary at which they are up (their start takes
            # seconds): step until the run is back at 4.
            if joined is not None and sizes[-1] == 4 and i >= 7:
                grow_back_s = time.monotonic() - joined
                break
        got = trainer.full_state_dict()
        recoveries = [r.summary() for r in trainer.recoveries]
        events = list(trainer.events)
    finally:
        trainer.shutdown()
        ray.shutdown()
        cluster.shutdown()
    ref, _ = single_process(fn, mse_loss, opt, batches)
    dev = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    print(json.dumps({"dev": dev, "sizes": sizes, "recoveries": recoveries, "events": events,
                      "grow_back_s": grow_back_s}))


if __name__ == "__main__":
    main()
