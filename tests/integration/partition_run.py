"""Run by test_partitions.py inside the head node's namespace of a simulated 2-node cluster (two
owners a node, stage 2 with peer redundancy, SGD, the driver on the head): the other node's
link is cut while every process lives, first for SHORT_CUT_S (shorter than health_timeout_s and
collective_timeout_s), then for longer than both; after the grow back an owner is SIGKILLed. Prints one JSON line: the deviation from the
single process over every step taken, what each cut did (steps' seconds, the recoveries, whether
a probe across the link failed during the cut and opened after it, Ray's view of the node) and
when the run was back at four owners."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time

import ray
import torch

import zero_ray as zr
from benchmarks.harness.simcluster import GCS_PORT, cut_link, reachable, restore_link
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

SHORT_CUT_S = 5.0
HEALTH_TIMEOUT_S = 12.0
COLLECTIVE_TIMEOUT_S = 15.0
GROW_BACK_WITHIN_S = 120.0  # bound on the wait for the run to be back at four owners


def batch(k: int) -> torch.Tensor:
    return torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1000 + k))


def node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    other_ns, head_ip, long_cut_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fn = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    opt = zr.SGD(lr=0.1)
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s")
    logging.getLogger("zero_ray").setLevel(logging.INFO)  # the recovery's and grow's steps, on stderr
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    cfg = zr.ZeroConfig(stage=2, world_size=4, device="cpu", bucket_bytes=1 << 16,
                        health_timeout_s=HEALTH_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                        elastic=zr.ElasticConfig(redundancy="peer", grow_check_s=1.0))
    out: dict[str, object] = {"health_timeout_s": HEALTH_TIMEOUT_S, "collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    steps = 0

    def step(trainer: zr.ZeroTrainer) -> float:
        nonlocal steps
        t0 = time.perf_counter()
        trainer.step(batch(steps))
        steps += 1
        return time.perf_counter() - t0

    with zr.ZeroTrainer(fn, lm_loss, optimizer=opt, config=cfg) as trainer:
        for _ in range(2):
            step(trainer)
        nodes = [r["node_id"] for r in ray.get([a.node.remote() for a in trainer._pool.actors])]
        head = ray.get_runtime_context().get_node_id()
        other = next(n for n in nodes if n != head)
        out["nodes"], out["head"] = nodes, head

        # (a) a short cut: the step sent into it waits for the link and completes.
        cut_link(other_ns)
        t_cut = time.perf_counter()
        restorer = threading.Timer(SHORT_CUT_S, restore_link, args=(other_ns,))
        restorer.start()
        probe_during = reachable(other_ns, head_ip, GCS_PORT, timeout_s=1.0)
        short_step_s = step(trainer)
        restorer.join(timeout=30)
        out["short"] = {"probe_during": probe_during, "probe_after": reachable(other_ns, head_ip, GCS_PORT, timeout_s=5.0),
                        "step_s": short_step_s, "cut_to_step_end_s": time.perf_counter() - t_cut,
                        "recoveries": len(trainer.recoveries), "world_size": trainer.world_size}
        step(trainer)

        # (b) a long cut: the side the driver cannot reach is lost, the head's group goes on.
        cut_link(other_ns)
        t_cut = time.perf_counter()
        probe_during = reachable(other_ns, head_ip, GCS_PORT, timeout_s=1.0)
        lost_step_s = step(trainer)
        during = [step(trainer) for _ in range(2)]
        remaining = long_cut_s - (time.perf_counter() - t_cut)
        alive_polls: list[tuple[float, bool]] = []
        while remaining > 0:  # no step to take: Ray's view of the node, every second, until the cut ends
            alive_polls.append((round(time.perf_counter() - t_cut, 1), node_alive(other)))
            time.sleep(min(1.0, remaining))
            remaining = long_cut_s - (time.perf_counter() - t_cut)
        restore_link(other_ns)
        t_restore = time.perf_counter()
        out["long"] = {"probe_during": probe_during, "cut_s": t_restore - t_cut, "lost_step_s": lost_step_s,
                       "steps_during_s": during, "world_size_during": trainer.world_size,
                       "node_dead_after_s": next((t for t, a in alive_polls if not a), None),
                       "recoveries": [r.summary() for r in trainer.recoveries],
                       "reports": [{"lost": sorted(r.lost), "outcome": r.outcome.value, "source": r.source and r.source.value,
                                    "detect_s": r.detect_s, "abort_s": r.abort_s, "restore_s": r.restore_s,
                                    "replay_s": r.replay_s, "before": r.world_size_before, "after": r.world_size_after}
                                   for r in trainer.recoveries]}
        # Grow back: steps go on until the run is at four owners again (or the bound).
        free: list[tuple[float, float, int]] = []  # (s since the restore, free CPUs, replacements' slots)
        while trainer.world_size < 4 and time.perf_counter() - t_restore < GROW_BACK_WITHIN_S:
            step(trainer)
            if not free or time.perf_counter() - t_restore - free[-1][0] >= 1.0:
                free.append((round(time.perf_counter() - t_restore, 1), ray.available_resources().get("CPU", 0.0),
                             trainer._pool.replacements.slots))
        out["long"]["free_after_restore"] = free
        out["long"]["probe_after"] = reachable(other_ns, head_ip, GCS_PORT, timeout_s=5.0)
        out["long"]["node_alive_after"] = node_alive(other)
        out["long"]["grow_back_s"] = time.perf_counter() - t_restore if trainer.world_size == 4 else None
        step(trainer)

        # (c) then an owner's SIGKILL (a fault of another kind, in the same run): the grown-back
        # owner on the other node, restored from its peer's copy, the run going on at three.
        seen, rank = len(trainer.recoveries), 1 if trainer.world_size > 1 else 0
        pid = ray.get(trainer.actors[rank].node.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        for _ in range(2):
            step(trainer)
        out["kill"] = {"rank": rank, "pid_gone": not _alive(pid),
                       "reports": [{"lost": sorted(r.lost), "source": r.source and r.source.value,
                                    "after": r.world_size_after} for r in trainer.recoveries[seen:]]}
        out["world_size_end"] = trainer.world_size
        out["nodes_end"] = [r["node_id"] for r in ray.get([a.node.remote() for a in trainer._pool.actors])]
        got = trainer.full_state_dict()
    ray.shutdown()
    ref, _ = single_process(fn, lm_loss, opt, [batch(k) for k in range(steps)])
    out["steps"] = steps
    out["dev"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
