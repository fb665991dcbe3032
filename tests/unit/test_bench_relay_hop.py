"""The relay-hop benchmark: one tiny real run (2 simulated owners under a served relay, 3 calls),
untimed: every figure is there and the relayed steps came back whole."""

from __future__ import annotations

import math

from benchmarks.relay_hop import measure


# About 5 s on a loaded two-core machine, most of it two spawned processes importing torch.
def test_two_owners_under_one_hop_give_every_figure() -> None:
    row = measure(owners=2, calls=3)  # raises if a relayed step failed or missed a rank
    assert (row["owners"], row["calls"]) == (2, 3)
    for key in ("direct_fan_out_ms", "relayed_ms", "hop_added_ms", "hop_cpu_ms_per_relay_step",
                "hop_idle_cpu_ms_per_call"):
        assert math.isfinite(row[key]), (key, row[key])
    assert row["direct_fan_out_ms"] > 0 and row["relayed_ms"] > 0
