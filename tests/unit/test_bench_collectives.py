"""The collectives micro-benchmark's pure parts, without Ray: summarising rounds, the table,
the JSON round trip, the target notes, the configuration and ``--render``."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.collectives import (
    BASELINE,
    CollectiveRow,
    CollectivesConfig,
    CollectivesResults,
    main,
    read_results,
    render_markdown,
    summarise_rounds,
    table_rows,
    target_notes,
    write_results,
)
from benchmarks.harness.report import machine_line
from benchmarks.harness.stats import Summary
from zero_ray.errors import ConfigError

MIB = 2**20


def _s(median: float) -> Summary:
    return Summary(median=median, min=median * 0.9, max=median * 1.2, n=5)


def _row(world_size: int, mib: int, *, ar: float, rs: float, ag: float) -> CollectiveRow:
    return CollectiveRow(world_size=world_size, size_bytes=mib * MIB,
                         times_ms={"all_reduce": _s(ar), "ring_all_reduce": _s(ar * 1.1), "reduce_scatter": _s(rs),
                                   "all_gather": _s(ag)})


def fake_results() -> CollectivesResults:
    rows = (_row(2, 1, ar=2.0, rs=1.0, ag=1.0), _row(4, 256, ar=1000.0, rs=600.0, ag=500.0))
    return CollectivesResults(
        machine={"cpu_model": "Test CPU", "logical_cpus": 2, "physical_cores": 2, "torch": "2.13.0",
                 "ray": "2.60.0", "date": "2026-01-01T00:00:00+00:00", "loadavg_start": [0.5, 0.4, 0.3],
                 "loadavg_end": [0.7, 0.5, 0.3]},
        settings={"sizes_mib": [1, 256], "world_sizes": [2, 4], "rounds": 5, "warmup": 2, "target": 0.55},
        rows=rows, notes=tuple(target_notes(rows, 0.55)))


def test_rounds_take_the_slowest_rank_and_skip_the_warm_up() -> None:
    ops = ("all_reduce", "reduce_scatter")
    rounds = [[dict.fromkeys(ops, 9.0), dict.fromkeys(ops, 9.0)]]  # warm-up: ignored
    rounds += [[{"all_reduce": 0.010 * i, "reduce_scatter": 0.004}, {"all_reduce": 0.001, "reduce_scatter": 0.005}]
               for i in (1, 2, 3)]
    got = summarise_rounds(rounds, warmup=1)
    assert set(got) == set(ops)
    assert got["all_reduce"].median == pytest.approx(20.0) and got["all_reduce"].n == 3
    assert got["reduce_scatter"].median == pytest.approx(5.0)  # rank 1 is the slower one
    with pytest.raises(ConfigError, match="no rounds"):
        summarise_rounds(rounds[:1], warmup=1)


def test_ratios_and_misses() -> None:
    row = _row(4, 256, ar=1000.0, rs=600.0, ag=500.0)
    assert row.ratio("reduce_scatter") == pytest.approx(0.6) and row.ratio(BASELINE) == 1.0
    assert row.misses(0.55) == ["reduce_scatter"] and row.misses(0.6) == []
    with pytest.raises(ConfigError, match="baseline"):
        CollectiveRow(world_size=2, size_bytes=MIB, times_ms={"reduce_scatter": _s(1.0)})


def test_table_has_times_ratios_and_the_target_column() -> None:
    header, cells = table_rows(fake_results())
    assert header[:3] == ["ranks", "buffer", "all-reduce (gloo) ms"]
    assert "reduce-scatter / all-reduce" in header and header[-1] == "≤ 0.55x"
    small, large = cells
    assert small[:2] == ["2", "1.00 MiB"] and small[-1] == "yes"
    assert small[header.index("reduce-scatter / all-reduce")] == "0.50"
    assert large[header.index("all-reduce (gloo) ms")] == "1000 (900 – 1200)"
    assert large[-1] == "no: reduce-scatter"


def test_markdown_names_the_machine_and_explains_misses() -> None:
    results = fake_results()
    md = render_markdown(results)
    assert machine_line(results.machine, libraries=("torch", "ray")) in md
    assert "load [0.5, 0.4, 0.3] → [0.7, 0.5, 0.3]" in md and "deepspeed" not in md
    assert md.count("\n| ") == 3  # the header and two rows
    assert "above the 0.55x target: 4 ranks / 256 MiB reduce-scatter (0.60x)" in md
    assert target_notes(results.rows[:1], 0.55) == []


def test_json_round_trip_and_render(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    results = fake_results()
    written = write_results(results, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["collectives.json", "collectives.md"]
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert data["schema"] == 1 and data["rows"][1]["ratio_to_all_reduce"]["all_gather"] == 0.5
    assert read_results(written[0]) == results
    out = tmp_path / "again"
    assert main(["--render", written[0], "--output-dir", str(out), "--quiet"]) == 0
    assert (out / "collectives.md").read_text() == render_markdown(results)
    assert "| 4 | 256 MiB |" in capsys.readouterr().out
    data["schema"] = 99
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="schema"):
        read_results(str(tmp_path / "old.json"))


@pytest.mark.parametrize("kwargs, match", [
    ({"world_sizes": (1,)}, "at least 2 ranks"),
    ({"sizes_mib": ()}, "non-empty"),
    ({"world_sizes": (3,), "sizes_mib": (1,)}, "does not split into 3"),
    ({"rounds": 0}, "rounds"),
    ({"target": 0.0}, "target"),
])
def test_config_is_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CollectivesConfig(**kwargs)


def test_hop_timings_get_columns_of_their_own() -> None:
    row = _row(4, 16, ar=30.0, rs=20.0, ag=15.0)
    row.times_ms.update(hop=_s(6.0), add=_s(0.5))
    results = CollectivesResults(machine={}, settings={"target": 0.55, "hops": True}, rows=(row,))
    header, (cells,) = table_rows(results)
    assert header[-3:] == ["one hop / all-reduce", "one add / all-reduce", "≤ 0.55x"]
    assert cells[header.index("one hop ms")] == "6.00 (5.40 – 7.20)"
    assert row.misses(0.55) == ["reduce_scatter"]  # hops are shown, never held to the target
    assert "one hop: one ring step's exchange" in render_markdown(results)
    assert CollectivesResults.from_dict(results.to_dict()) == results
