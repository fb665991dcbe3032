"""A simulated 2-node cluster (network namespaces, benchmarks/harness/simcluster.py): stage 3
with shard groups of a node and hpZ matches the single process, and the cross-node bytes the
owners count (comm_report) are what the kernel counted between the nodes; then the other node is
lost whole (its raylet and owners SIGKILLed) and the run goes on exactly on the head node's
group, with no peer snapshots or checkpoint. Skips, with the reason, where namespaces cannot be
made."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.harness.simcluster import SimCluster, available
from tests_paths import REPO_ROOT

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no simulated cluster here: {WHY}")


def test_two_node_cluster_parity_cross_node_bytes_and_a_lost_node() -> None:
    with SimCluster(nodes=2, cpus_per_node=2, link_mbit=1000, delay_ms=0.5) as cluster:
        namespaces = [n.namespace for n in cluster.members]
        got = cluster.run_in_head([sys.executable, "tests/integration/multinode_run.py", ",".join(namespaces),
                                   cluster.members[1].namespace], timeout_s=600,
                                  cwd=REPO_ROOT, extra_env={"PYTHONPATH": REPO_ROOT})
        link = cluster.link
    assert got.returncode == 0, got.stderr[-4000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    print(f"links: {link}")
    print(f"lost node: {out['summaries']}; next step {out['next_step_s']:.2f}s; dev {out['dev']:.2e}")
    assert out["dev"] <= 1e-5
    assert len(set(out["nodes"])) == 2 and out["nodes"].count(out["nodes"][0]) == 2  # two owners per node
    # Gradient shards are all-reduced across the nodes (and the step's few scalars); parameters
    # never leave one.
    assert 0 < out["across"] <= out["comm_cross"] <= out["across"] + 4096
    # The kernel saw at least that many bytes cross, plus TCP/IP headers and Ray's own messages.
    assert out["comm_cross"] <= out["iface"] <= 1.2 * out["comm_cross"] + 2**20
    # The lost node: its two owners and raylet gone; the head node's group goes on from
    # its own live state, hpZ's secondary partition rebuilt; the step after the loss (detection,
    # restore, replay) within health_timeout_s + 5 s.
    assert out["killed"] >= 3
    assert len(out["on_other"]) == 2
    assert out["recoveries"] == [["restored", "replica", out["on_other"], 2]]
    assert len(out["secondary"]) == 2 and all(b > 0 for b in out["secondary"])
    assert out["next_step_s"] <= out["health_timeout_s"] + 5
    # Torn down by name: no namespace of the cluster is left.
    import subprocess

    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert not any(ns in left for ns in namespaces)
