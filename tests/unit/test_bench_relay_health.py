"""The relay-health benchmark: one tiny real run (2 nodes of 2 simulated owners under served
relays), untimed: every way of watching ran, lost no rank, and gave its figures."""

from __future__ import annotations

import math

from benchmarks.relay_health import measure


# A few seconds: two spawned processes, a second's warm-up per way of watching.
def test_every_way_of_watching_gives_its_figures() -> None:
    rows = measure(nodes=2, per_node=2, fan_out=2, interval_s=0.05, seconds=0.3)  # raises on a lost rank
    assert [(r["watch"], r["streams"]) for r in rows] == [
        ("nothing (idle caller)", 0), ("direct (every owner)", 4), ("node relays", 2), ("top relays", 2)]
    for row in rows:
        assert math.isfinite(row["cpu_s_per_s"]) and row["cpu_s_per_s"] >= 0
        assert row["owners"] == 4 and math.isfinite(row["pct_core_per_100_nodes_at_2_5s"])
