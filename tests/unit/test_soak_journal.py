"""The soak's journal (benchmarks/harness/soak_journal.py): what a SIGKILLed driver wrote is read
back whole, a line cut short waits for its end, and the supervisor's attribution of recoveries
and time lost to faults reads the journal's records (benchmarks/harness/soak_faults.attribute).
Pure: files and arithmetic, milliseconds."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.harness.goodput import StepAt
from benchmarks.harness.soak_faults import DRIVER_SIGKILL, KINDS, NOT_INJECTED, FaultRecord, attribute, schedule
from benchmarks.harness.soak_journal import Attached, Journal, JournalState, Recovered, read


def _recovered(step: int, detect: float) -> Recovered:
    return Recovered(failed_step=step, detect_s=detect, abort_s=0.1, restore_s=0.5, replay_s=0.2, replayed_steps=1,
                     summary=f"step {step} failed")


def test_every_line_a_killed_driver_wrote_is_read_back(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.jsonl")
    j = Journal(path)
    j.write("run", {"run_id": "ab12", "pid": 10})
    j.write("t0", 1234.5)
    j.step(StepAt(t_s=1.0, step=21, size=4))
    j.write("recovery", asdict(_recovered(22, 1.5)))
    rec = FaultRecord(kind=DRIVER_SIGKILL, planned_s=30.0, at_s=31.0, at_step=21)
    j.write("fault", {"index": 0, "record": asdict(rec), "size": 4})
    j.write("kill", 10)
    j.write("committed", ["s3://soak/run/step-00000050", 50])
    j.write("run", {"run_id": "ab12", "pid": 11})
    j.write("ready", {"pid": 11, "at": 1267.0})
    j.write("attached", asdict(Attached(t_s=35.0, step=22, pid=11)))
    rec.settled_s = 4.5
    j.write("fault", {"index": 0, "record": asdict(rec), "size": 3})  # the last line of an index wins
    got = read(path)
    assert (got.run_id, got.pids, got.t0, got.kills, got.size) == ("ab12", [10, 11], 1234.5, [10], 3)
    assert got.steps == [StepAt(t_s=1.0, step=21, size=4)] and got.recoveries == [_recovered(22, 1.5)]
    assert FaultRecord(**got.faults[0]).settled_s == 4.5 and list(got.faults) == [0]
    assert got.committed == [("s3://soak/run/step-00000050", 50)]
    assert got.attached == [Attached(t_s=35.0, step=22, pid=11)] and got.end is None
    assert got.ready == {11: 1267.0}


def test_a_line_still_being_written_waits_for_its_end(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    reader = Journal(str(path))
    path.write_text('{"t0": 1.0}\n{"kill": 4')
    assert reader.read_new() == [{"t0": 1.0}]
    with path.open("a") as f:
        f.write("2}\n")
    assert reader.read_new() == [{"kill": 42}] and reader.read_new() == []


def test_an_unknown_line_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown journal line"):
        JournalState().add({"mystery": 1})


def test_recoveries_and_time_lost_go_to_the_fault_whose_window_holds_them() -> None:
    records = [FaultRecord(kind="owner_sigkill", planned_s=10, at_s=10.0, at_step=100),
               FaultRecord(kind="owner_sigstop", planned_s=20, at_s=20.0, at_step=150)]
    reports = [_recovered(101, 1.5), _recovered(151, 9.2), _recovered(90, 7.0)]  # the last: before any fault
    steps = [StepAt(t_s=10.0 + k * 0.2, step=100 + k, size=4) for k in range(1, 51)]  # 10.2 .. 20.0 s
    steps += [StepAt(t_s=30.0 + k * 0.2, step=150 + k, size=3) for k in range(1, 11)]  # 30.2 .. 32.0 s
    attribute(records, reports, steps, 32.0, {4: 0.2, 3: 0.1})
    first, second = records
    assert first.detect_s == 1.5 and first.steps_lost == 1 and first.recoveries == ["step 101 failed"]
    assert first.window_steps == 50 and first.lost_s == pytest.approx(0.0, abs=1e-6)
    assert second.detect_s == 9.2 and second.window_s == 12.0 and second.window_steps == 10
    assert second.lost_s == pytest.approx(12.0 - 10 * 0.1)


def test_the_driver_sigkill_is_a_kind_of_the_seeded_schedule() -> None:
    assert DRIVER_SIGKILL in KINDS and not NOT_INJECTED
    plan = schedule(seed=46, duration_s=120, interval_s=30, kinds=(DRIVER_SIGKILL, "owner_sigkill"))
    assert [p.kind for p in plan] == ["owner_sigkill", DRIVER_SIGKILL, DRIVER_SIGKILL]


def test_soak_seconds_leave_out_the_calibrations_begun_before() -> None:
    from benchmarks.harness.goodput import Calibration

    state = JournalState(t0=1000.0)
    for c in (Calibration(at_s=100.0, size=4, steps=100, s=10.0, valid=True, paused_s=10.0),  # monotonic 1100-1110
              Calibration(at_s=200.0, size=4, steps=100, s=30.0, valid=False, paused_s=30.0),  # the soak's own time
              # a round at 3 and at 2 (a resize there, warm steps, and back): monotonic 1340-1348
              Calibration(at_s=300.0, size=3, steps=100, s=5.0, valid=True, paused_s=8.0),
              Calibration(at_s=300.0, size=2, steps=100, s=2.0, valid=True)):
        state.add({"calibration": asdict(c)})
    assert state.paused_s == pytest.approx(18.0)
    assert state.soak_s(1050.0) == pytest.approx(50.0)
    assert state.soak_s(1200.0) == pytest.approx(190.0)
    assert state.soak_s(1400.0) == pytest.approx(382.0)
