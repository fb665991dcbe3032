"""Link cuts on a simulated 2-node cluster (benchmarks/harness/simcluster.py), every process
alive (docs/elastic.md, "Partitions"): a cut shorter than health_timeout_s and
collective_timeout_s is ridden through with no recovery; a longer one loses the side the driver
cannot reach (the other node's two owners), the head node's owners go on from the peer copies
they hold, and the run grows back to four owners once the link returns. The run ends equal to
the single process over every step it took (SGD, 1e-6), and a probe across the link failed
during each cut and opened after it. Then an owner's SIGKILL (the soak's most common fault,
benchmarks/soak.py) loses exactly that rank, restored from its peer's copy. Skips, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.harness.simcluster import SimCluster, available
from tests_paths import REPO_ROOT

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no simulated cluster here: {WHY}")

LONG_CUT_S = 17.0  # longer than health_timeout_s (12) and collective_timeout_s (15) in partition_run.py


def test_a_short_cut_is_ridden_through_and_a_long_one_loses_the_far_side_then_grows_back() -> None:
    with SimCluster(nodes=2, cpus_per_node=2, link_mbit=1000, delay_ms=0.0) as cluster:
        got = cluster.run_in_head([sys.executable, "tests/integration/partition_run.py", cluster.members[1].namespace,
                                   cluster.members[0].ip, f"{LONG_CUT_S:g}"], timeout_s=600, cwd=REPO_ROOT,
                                  extra_env={"PYTHONPATH": REPO_ROOT})
    assert got.returncode == 0, got.stderr[-4000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
    print("\n".join(line for line in got.stderr.splitlines() if " zero_ray" in line))
    short, long = out["short"], out["long"]
    assert out["dev"] <= 1e-6
    # Each cut fired: nothing crossed the link while it was down, and it opened after.
    assert not short["probe_during"] and short["probe_after"]
    assert not long["probe_during"] and long["probe_after"]
    # (a) ridden through: no recovery, four owners, the step waited for the link.
    assert short["recoveries"] == 0 and short["world_size"] == 4
    # (b) the other node's two owners lost, restored from the copies their peers on the head hold.
    on_other = [r for r, n in enumerate(out["nodes"]) if n != out["head"]]
    assert len(on_other) == 2
    assert [(r["lost"], r["source"], r["after"]) for r in long["reports"]] == [(on_other, "peer", 2)]
    assert long["world_size_during"] == 2
    assert long["grow_back_s"] is not None
    # (c) the SIGKILL after the grow back fired (the process is gone) and lost exactly that rank.
    kill = out["kill"]
    assert kill["pid_gone"] and kill["reports"] == [{"lost": [kill["rank"]], "source": "peer", "after": 3}]
    assert out["world_size_end"] in (3, 4)  # the replacement may have joined by the last step
