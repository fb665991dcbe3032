"""The control-plane scale benchmark: one tiny real run (2 simulated owners, 3 steps) in a
subprocess, and the goal notes on made-up rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.control_measure import ScaleRow, measure
from benchmarks.control_scale import main, notes, table

ROOT = Path(__file__).resolve().parents[2]
ISSUE_KEYS = {"owners", "driver_added_ms_per_step", "driver_cpu_cores", "heartbeat_cpu_cores", "loss_to_decision_s"}


# About 7 s on a quiet two-core machine, most of it this process and the fork server importing torch.
def test_two_owners_three_steps_write_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "benchmarks.control_scale", "--owners", "2", "--steps", "3", "--warmup", "1",
               "--heartbeat-window-s", "1", "--health-interval-s", "1", "--probe-calls", "4", "--results-dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data == json.loads((tmp_path / "control_scale.json").read_text())
    assert "| 2 |" in (tmp_path / "control_scale.md").read_text()
    [row] = data["rows"]
    assert data["failed"] == []
    assert ISSUE_KEYS <= row.keys() and row["owners"] == 2
    for key in ("driver_added_ms_per_step", "driver_cpu_cores", "loss_to_decision_s", "health_detect_s",
                "step_wall_ms", "driver_cpu_ms_per_step", "heartbeats_per_s", "stats_fanout_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    # Heartbeats less the idle baseline: never negative; zero only within a short window's noise.
    assert math.isfinite(row["heartbeat_cpu_cores"]) and row["heartbeat_cpu_cores"] >= 0
    assert row["step_wall_ms"] >= 20.0  # the stand-in computes 20 ms
    assert math.isfinite(row["pipelined_added_ms_per_step"]) and row["pipelined_added_ms_per_step"] > -1.0
    assert 0 < row["pipelined_cpu_cores"] < 2.5
    assert row["loss_to_decision_s"] < 10.0  # a killed process's sockets close: no heartbeat timeout
    assert row["lost_rank_ok"] is True and row["false_losses"] == 0
    assert row["aborted_ranks"] == 1 and row["abort_survivors_s"] >= 0  # the survivor took the abort once
    assert 0 < row["max_beat_age_s"] < 10.0
    assert 1.0 <= row["heartbeats_per_s"] <= 4.0  # 2 owners, one beat a second each


def test_steps_down_the_relay_tree_write_their_rows_beside_the_direct_ones(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "benchmarks.control_scale", "--owners", "4", "--steps", "3", "--warmup", "1",
               "--heartbeat-window-s", "1", "--health-interval-s", "1", "--probe-calls", "4", "--relays", "2",
               "--owners-per-node", "2", "--results-dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data == json.loads((tmp_path / "control_scale_relays.json").read_text())
    assert not (tmp_path / "control_scale.json").exists()  # the direct rows are kept apart
    [row] = data["rows"]
    # two nodes of two owners: a node relay each, and the driver calls both
    assert (row["relay_fan_out"], row["relay_depth"], row["owners_per_node"]) == (2, 1, 2)
    assert row["step_wall_ms"] >= 20.0 and math.isnan(row["dispatch_ms"])
    assert row["lost_rank_ok"] is True and row["false_losses"] == 0 and row["loss_to_decision_s"] < 10.0
    # the survivors' abort: ranks 0-1 through node 0's relay, rank 2 directly (its node relay is
    # on the lost rank 3's path); each took it once, none twice
    assert row["aborted_ranks"] == 3
    assert "tree: fan-out 2, depth 1, 2/node" in (tmp_path / "control_scale_relays.md").read_text()


def test_stand_in_subtrees_put_real_top_relays_over_stand_ins(tmp_path: Path) -> None:
    # 8 owners on 4 nodes of 2, fan-out 2: 4 node relays, 2 top relays above them (depth 2), each
    # top relay real, its 2 children stood in (the last one alone: the victim)
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "benchmarks.control_scale", "--owners", "8", "--steps", "3", "--warmup", "1",
               "--heartbeat-window-s", "1", "--health-interval-s", "1", "--relays", "2", "--owners-per-node", "2",
               "--stand-in", "--results-dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data == json.loads((tmp_path / "control_scale_tree.json").read_text())
    [row] = data["rows"]
    assert (row["relay_depth"], row["top_relays"], row["below_driver"]) == (2, 2, "stand-in subtrees")
    assert row["step_wall_ms"] >= 20.0 and row["top_relays_cpu_ms_per_step"] > 0
    # the victim stand-in's host rank (6: the last node relay's) is the one the decision names
    assert row["lost_rank_ok"] is True and row["false_losses"] == 0 and row["loss_to_decision_s"] < 10.0
    # the survivors' abort went around the lost relay (rank 6's): the first top relay's subtree
    # through it, ranks 4-5 through their own relay, called directly, rank 7 (the lost relay's
    # own child) directly: every survivor once, none twice
    assert row["aborted_ranks"] == 7
    assert math.isnan(row["stats_fanout_ms"]) and len(row["loadavg"]) == 2
    # the stand-ins' own window: they compute the 20 ms, the rest is before and after it
    assert 15.0 <= row["compute_ms"] <= row["step_wall_ms"] and row["dispatch_ms"] > 0 and row["collect_ms"] > 0
    # fit's steps after the first: each one begun late on a subtree counted, with the time lost
    assert 0 <= row["pipelined_late_steps"] <= 2 and row["pipelined_late_ms"] >= 0.0
    assert "stand-in subtrees, 2 top relays" in (tmp_path / "control_scale_tree.md").read_text()


def _row(owners: int, *, added: float, cpu: float, beats: float, piped: float = 3.0) -> ScaleRow:
    return ScaleRow(owners=owners, driver_added_ms_per_step=added, driver_cpu_cores=cpu, heartbeat_cpu_cores=beats,
                    loss_to_decision_s=0.02, step_wall_ms=20 + added, dispatch_ms=added * 0.8, compute_ms=20.5,
                    collect_ms=1.0, driver_cpu_ms_per_step=cpu * (20 + added), driver_cpu_us_per_owner=400.0,
                    grpc_call_cpu_us=250.0, pool_handoff_cpu_us=60.0, stats_fanout_ms=added, driver_threads=3000,
                    heartbeats_per_s=owners, heartbeat_bytes_per_s=owners * 30.0, owners_heartbeat_cpu_cores=0.1,
                    health_detect_s=0.02, abort_survivors_s=0.3, lost_rank_ok=True, max_beat_age_s=1.5,
                    owners_max_beat_gap_s=1.1,
                    false_losses=0, false_loss_reason="", heartbeat_cpu_by_thread={},
                    step_cpu_by_thread={"zero_ray-rpc": 300.0}, pipelined_added_ms_per_step=piped,
                    pipelined_cpu_cores=0.9, top_relays_cpu_ms_per_step=0.0, loadavg=(1.0, 2.0),
                    pipelined_late_steps=2, pipelined_late_ms=31.5)


def test_notes_name_the_misses_at_1024_owners_and_the_heartbeat_budget() -> None:
    fine = _row(1024, added=4.0, cpu=0.1, beats=0.05)
    slow = _row(1024, added=400.0, cpu=1.2, beats=0.2, piped=300.0)
    assert notes([fine]) == ["1024 owners: loss → decision 0.02 s (goal < 1): met",
                             "1024 owners: added latency 4.0 ms/step (goal ≤ 10): met",
                             "1024 owners: added latency with fit's pipelined steps 3.0 ms/step (goal ≤ 5): met",
                             "1024 owners: driver CPU 2.4 ms/step (goal ≤ 5): met"]
    got = notes([slow])
    assert any("heartbeats MISS" in n and "budget 0.1024" in n for n in got)
    assert any("added latency 400.0 ms/step" in n and n.endswith("MISS") for n in got)
    assert any("pipelined steps 300.0 ms/step" in n and n.endswith("MISS") for n in got)
    assert any("driver CPU 504.0 ms/step" in n and n.endswith("MISS") for n in got)
    # At 8,192 owners only fit's latency and the decision have goals (and the heartbeat budget).
    large = notes([replace(fine, owners=8192, heartbeat_cpu_cores=0.001, pipelined_added_ms_per_step=12.0)])
    assert large == ["8192 owners: loss → decision 0.02 s (goal < 1): met",
                     "8192 owners: added latency with fit's pipelined steps 12.0 ms/step (goal ≤ 10): MISS"]
    # A relay's loss decided after the survivors' abort (3.2-4.9 s at 8,192 before issue 44's fix).
    assert "8192 owners: loss → decision 3.20 s (goal < 1): MISS" in notes([replace(fine, owners=8192,
                                                                                    loss_to_decision_s=3.2)])
    assert any("where the time goes" in n and "dispatch 320.0 ms" in n for n in got)
    assert any("CPU-bound (1.20 cores)" in n for n in got)
    # Below 1024 owners only the heartbeat budget is judged.
    assert notes([replace(fine, owners=64, heartbeat_cpu_cores=0.001)]) == []
    assert "| 1024 | direct | 400.0 | 300.0, 0.90 | 1.20 |" in table([slow])
    lossy = notes([replace(fine, owners=64, heartbeat_cpu_cores=0.001, false_losses=2, false_loss_reason="stall")])
    assert lossy == ["64 owners: live owners were declared lost (or a call timed out) 2 time(s), the monitor "
                     "restarted each time as a membership change does: stall"]


def test_a_single_owner_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--owners", "8,1"])
    assert exit_info.value.code == 2 and "counts >= 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a survivor"):
        measure(1, None)  # type: ignore[arg-type]


def test_render_recomputes_the_notes_from_the_rows(tmp_path: Path) -> None:
    slow = _row(1024, added=400.0, cpu=1.2, beats=0.2)
    source = tmp_path / "in.json"
    source.write_text(json.dumps({"machine": {"date": "2026-12-05"}, "settings": {
        "compute_ms": 20.0, "per_process": 128, "shared": "yes", "health_interval_s": 1.0, "steps": 20, "warmup": 2},
        "rows": [slow.as_json()], "failed": [{"owners": 2048, "error": "TimeoutError: too many"}], "notes": []}))
    out = tmp_path / "out"
    results = main(["--render", str(source), "--results-dir", str(out)])
    assert results["notes"] == notes([slow]) + ["2048 owners: no row: TimeoutError: too many"]
    assert ScaleRow.from_json(json.loads((out / "control_scale.json").read_text())["rows"][0]) == slow
    text = (out / "control_scale.md").read_text()
    assert "| 1024 | direct | 400.0 | 3.0, 0.90 | 1.20 |" in text and "2048 owners: no row" in text and "zero_ray-rpc 300" in text
    assert "| 2, 31.5 |\n" in text  # fit's steps begun late, and the time they lost
    assert "Other runs" not in text
    # the spread: other runs' rows rendered after the notes, each under its label
    data = json.loads(source.read_text())
    data["other_runs"] = [{"label": "run 2 (load 9)", "rows": [replace(slow, driver_added_ms_per_step=7.5).as_json()]}]
    source.write_text(json.dumps(data))
    main(["--render", str(source), "--results-dir", str(out)])
    text = (out / "control_scale.md").read_text()
    assert "run 2 (load 9):" in text and "| 1024 | direct | 7.5 |" in text.split("Other runs")[1]
