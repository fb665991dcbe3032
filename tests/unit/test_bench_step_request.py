"""The step-request benchmark: both ways build a step for every owner, the tree's top relays
counted as plan_relays plans them."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.step_request import main


def test_rows_name_the_top_relays_and_both_costs(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    rows = main(["--owners", "8,64,72", "--repeats", "3", "--json", str(out)])
    assert [(r["owners"], r["top_relays"]) for r in rows] == [(8, 1), (64, 8), (72, 2)]
    assert all(r["direct_ms"] > 0 and r["relayed_ms"] > 0 for r in rows)
    assert json.loads(out.read_text()) == rows
