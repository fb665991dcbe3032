"""What a link cut long enough for Ray's GCS to declare the cut node dead does (docs/elastic.md,
"Partitions"): a simulated 2-node cluster whose GCS health checks are fast (so the death comes
in seconds, not Ray's default tens of seconds), 2 owners a node, stage 2 with peer redundancy,
SGD. The other node's link is cut until the GCS has declared it dead, then restored; we time
its raylet's exit, then do what an operator must (``ray start`` on that node again) and time
the run's grow back to four owners. Prints one JSON line; the end state is checked against one
process over every step taken.

    python -m benchmarks.partition_dead_node
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

from benchmarks.harness.simcluster import SimCluster, available

FAST_GCS_CHECKS = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                   "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
BOUND_S = 120.0  # every wait below


def _raylets(namespace: str) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=20).stdout.split()
    out = []
    for pid in pids:
        try:
            if b"raylet" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]:
                out.append(int(pid))
        except OSError:
            continue
    return out


def driver(other_ns: str, other_ip: str, head_address: str) -> None:
    """Inside the head's namespace."""
    import ray
    import torch

    import zero_ray as zr
    from benchmarks.harness.simcluster import cut_link, restore_link
    from zero_ray.models import GPT, GPTConfig, lm_loss
    from zero_ray.testing import single_process

    def batch(k: int) -> torch.Tensor:
        return torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1000 + k))

    fn = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    opt = zr.SGD(lr=0.1)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    cfg = zr.ZeroConfig(stage=2, world_size=4, device="cpu", bucket_bytes=1 << 16, health_timeout_s=12.0,
                        collective_timeout_s=20.0, elastic=zr.ElasticConfig(redundancy="peer", grow_check_s=1.0))
    out: dict[str, object] = {}
    steps = 0
    with zr.ZeroTrainer(fn, lm_loss, optimizer=opt, config=cfg) as trainer:
        for _ in range(2):
            trainer.step(batch(steps))
            steps += 1
        nodes = [r["node_id"] for r in ray.get([a.node.remote() for a in trainer._pool.actors])]
        other = next(n for n in nodes if n != ray.get_runtime_context().get_node_id())
        cut_link(other_ns)
        t_cut = time.perf_counter()
        t0 = time.perf_counter()
        trainer.step(batch(steps))
        steps += 1
        out["lost_step_s"] = time.perf_counter() - t0
        out["recoveries"] = [r.summary() for r in trainer.recoveries]
        while any(n["NodeID"] == other and n["Alive"] for n in ray.nodes()) and time.perf_counter() - t_cut < BOUND_S:
            time.sleep(0.5)
        out["gcs_dead_after_cut_s"] = time.perf_counter() - t_cut
        restore_link(other_ns)
        t_restore = time.perf_counter()
        while _raylets(other_ns) and time.perf_counter() - t_restore < BOUND_S:
            time.sleep(0.5)
        out["raylet_exited_after_restore_s"] = None if _raylets(other_ns) else time.perf_counter() - t_restore
        for _ in range(3):  # no room comes back by itself: the run stays at two
            trainer.step(batch(steps))
            steps += 1
        out["world_size_before_ray_start"] = trainer.world_size
        # What an operator (or a node's supervisor: systemd, KubeRay) must do: start Ray there again.
        log = open("/tmp/partition_dead_node_raystart.log", "wb")
        subprocess.Popen(["ip", "netns", "exec", other_ns, sys.executable, "-m", "ray.scripts.scripts", "start",
                          "--block", f"--address={head_address}", f"--node-ip-address={other_ip}", "--num-cpus=2",
                          "--num-gpus=0", "--disable-usage-stats"], stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
        t_start = time.perf_counter()
        while trainer.world_size < 4 and time.perf_counter() - t_start < BOUND_S:
            trainer.step(batch(steps))
            steps += 1
        out["grow_back_after_ray_start_s"] = time.perf_counter() - t_start if trainer.world_size == 4 else None
        got = trainer.full_state_dict()
    ray.shutdown()
    ref, _ = single_process(fn, lm_loss, opt, [batch(k) for k in range(steps)])
    out["steps"] = steps
    out["dev"] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 1:
        driver(*sys.argv[1:4])
        return
    why = available()
    if why is not None:
        raise SystemExit(f"no simulated cluster here: {why}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with SimCluster(nodes=2, cpus_per_node=2, link_mbit=1000, delay_ms=0.0, ray_env=FAST_GCS_CHECKS) as cluster:
        other = cluster.members[1]
        got = cluster.run_in_head([sys.executable, "-m", "benchmarks.partition_dead_node", other.namespace, other.ip,
                                   cluster.address], timeout_s=600, cwd=repo, extra_env={"PYTHONPATH": repo})
    print(got.stderr[-3000:] if got.returncode else got.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
