"""Run by test_capacity_wait.py in its own process (it needs a Ray of its own): a trainer of 2
owners starts on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
nodes as ``ray start`` makes them) whose only node has room for 1; a second node joins 5 s
after the trainer started (and never before its waiting line), by the clock, and the trainer
must then start and train.

Prints one JSON line with what happened; the parent test asserts on it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster

import zero_ray as zr
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

# The second node joins this long after the trainer started: several of start-up's room polls
# (ROOM_POLL_S = 1 s) find no room first; 20 s had waited 15 s more for nothing.
JOIN_AFTER_S = 5.0
WAITING_LINE_S = 15.0  # the waiting line must have been logged within this (it is logged at once)
START_AFTER_JOIN_S = 60.0  # the trainer must be up within this of the join


class Lines(logging.Handler):
    """Every zero_ray log line, with when it came; ``waiting`` is set by the first waiting line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []
        self.waiting = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.lines.append((time.monotonic(), text))
        if text.startswith("waiting for"):
            self.waiting.set()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    lines = Lines()
    logger = logging.getLogger("zero_ray")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    built: dict[str, Any] = {}
    out: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        fn = functools.partial(mlp, 16, 2)
        opt = zr.SGD(lr=0.05, momentum=0.9)
        cfg = zr.ZeroConfig(stage=2, world_size=2, device="cpu", bucket_bytes=4096, capacity_timeout_s=90.0,
                            health_timeout_s=5.0, collective_timeout_s=30.0)

        def build() -> None:
            try:
                built["trainer"] = zr.ZeroTrainer(fn, mse_loss, optimizer=opt, config=cfg)
            except BaseException as err:  # reported in the JSON line, asserted on by the test
                built["error"] = repr(err)

        started = time.monotonic()
        thread = threading.Thread(target=build, name="build-trainer", daemon=True)
        thread.start()
        out["waiting_logged"] = lines.waiting.wait(timeout=WAITING_LINE_S)
        # The join is triggered by the clock, not by anything the trainer does.
        time.sleep(max(0.0, started + JOIN_AFTER_S - time.monotonic()))
        out["constructing_at_join"] = thread.is_alive()
        out["nodes_at_join"] = sum(1 for n in ray.nodes() if n.get("Alive"))
        out["free_cpu_at_join"] = ray.available_resources().get("CPU", 0.0)
        cluster.add_node(num_cpus=1)
        joined = time.monotonic()
        thread.join(timeout=START_AFTER_JOIN_S)
        out["started_after_join_s"] = None if thread.is_alive() else time.monotonic() - joined
        out["error"] = built.get("error")
        out["waiting_lines"] = [text for t, text in lines.lines if text.startswith("waiting for")]
        out["waiting_lines_before_join"] = sum(1 for t, text in lines.lines if text.startswith("waiting for")
                                               and t < joined)
        trainer = built.get("trainer")
        if trainer is not None:
            with trainer:
                g = torch.Generator().manual_seed(5)
                batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(2)]
                out["losses"] = [trainer.step(b)["loss"] for b in batches]
                out["owner_nodes"] = len({n["node_id"] for n in trainer._pool.nodes})
                got = trainer.full_state_dict()
            ref, ref_losses = single_process(fn, mse_loss, opt, batches)
            out["ref_losses"] = ref_losses
            out["dev"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        out["total_s"] = time.monotonic() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
