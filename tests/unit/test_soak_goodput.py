"""The soak's fair goodput (benchmarks/harness/goodput.py): each size's steps credited with that
size's fault-free time, over the soak's wall time; pure arithmetic, milliseconds."""

from __future__ import annotations

import pytest

from benchmarks.harness.goodput import StepAt, fault_free_step_s, goodput, shares, window_fault_free_s


def test_each_size_is_credited_with_its_own_fault_free_time() -> None:
    # 3 steps at 4 owners (0.3 s each fault-free), then 2 at 3 owners (0.2 s each); 2.0 s of wall.
    steps = [StepAt(t_s=0.4, step=1, size=4), StepAt(t_s=0.7, step=2, size=4), StepAt(t_s=1.0, step=3, size=4),
             StepAt(t_s=1.5, step=4, size=3), StepAt(t_s=1.7, step=5, size=3)]
    parts = shares(steps, end_s=2.0, baseline={4: 0.3, 3: 0.2, 2: 0.1})
    assert [(p.size, p.steps, p.measured) for p in parts] == [(3, 2, True), (4, 3, True)]
    by = {p.size: p for p in parts}
    assert by[4].s == pytest.approx(1.0) and by[3].s == pytest.approx(1.0)  # the 0.3 s tail goes to size 3
    assert by[4].fault_free_s == pytest.approx(0.9) and by[3].fault_free_s == pytest.approx(0.4)
    assert goodput(parts, wall_s=2.0) == pytest.approx(1.3 / 2.0)
    # The old measure credited every step with the 4-owner time: 5 x 0.3 / 2.0 = 75%, not 65%.
    assert goodput(parts, wall_s=2.0) < 5 * 0.3 / 2.0


def test_a_soak_at_a_faster_size_is_not_above_100_percent_when_fault_free() -> None:
    # Fault-free at 3 owners, exactly the baseline's pace: 100%, where the 4-owner baseline said 150%.
    steps = [StepAt(t_s=0.2 * (k + 1), step=k, size=3) for k in range(10)]
    parts = shares(steps, end_s=2.0, baseline={4: 0.3, 3: 0.2})
    assert goodput(parts, wall_s=2.0) == pytest.approx(1.0)


def test_an_unmeasured_size_gets_the_smallest_credit_and_says_so() -> None:
    assert fault_free_step_s(1, {4: 0.3, 3: 0.2}) == (0.2, False)
    assert fault_free_step_s(4, {4: 0.3, 3: 0.2}) == (0.3, True)
    parts = shares([StepAt(t_s=1.0, step=1, size=1)], end_s=1.0, baseline={4: 0.3, 3: 0.2})
    assert parts[0].measured is False and parts[0].fault_free_s == pytest.approx(0.2)


def test_a_window_is_valued_step_by_step() -> None:
    window = [StepAt(t_s=1.0, step=1, size=4), StepAt(t_s=2.0, step=2, size=2)]
    assert window_fault_free_s(window, {4: 0.3, 2: 0.1}) == pytest.approx(0.4)
    assert window_fault_free_s([], {4: 0.3}) == 0.0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="no fault-free baseline"):
        fault_free_step_s(4, {})
    with pytest.raises(ValueError, match="positive"):
        fault_free_step_s(4, {4: 0.0})
    with pytest.raises(ValueError, match="order"):
        shares([StepAt(t_s=2.0, step=1, size=4), StepAt(t_s=1.0, step=2, size=4)], end_s=3.0, baseline={4: 0.3})
    with pytest.raises(ValueError, match="wall time"):
        goodput([], wall_s=0.0)


def test_a_windows_time_lost_splits_into_stall_grow_fewer_owners_and_slower_steps() -> None:
    from benchmarks.harness.goodput import StepAt, window_fault_free_s, window_parts

    base = {4: 0.1, 2: 0.05}
    # the fault at 10.0 s (the step before it at 10.0): a 3 s stall, two steps at 2 owners 0.1 s
    # apart, a grow back's 2 s pause, then steps at 4 owners 0.15 s apart
    steps = [StepAt(t_s=13.0, step=2, size=2), StepAt(t_s=13.1, step=3, size=2), StepAt(t_s=13.2, step=4, size=2),
             StepAt(t_s=15.2, step=5, size=4), StepAt(t_s=15.35, step=6, size=4), StepAt(t_s=15.5, step=7, size=4)]
    got = window_parts(steps, start_s=10.0, end_s=15.5, size=4, before_s=10.0, baseline=base)
    assert got.stalls == (3.0,) and abs(got.stall_s - 2.95) < 1e-9
    assert abs(got.smaller_s - 0.1) < 1e-9 and abs(got.grow_s - 1.9) < 1e-9 and abs(got.slow_s - 0.1) < 1e-9
    lost = (15.5 - 10.0) - window_fault_free_s(steps, base)
    assert abs(got.stall_s + got.smaller_s + got.grow_s + got.slow_s - lost) < 1e-9  # the parts are the whole


def test_the_soaks_own_pace_leaves_out_stalls_and_size_changes() -> None:
    from benchmarks.harness.goodput import StepAt, pace_s

    steps = [StepAt(t_s=t, step=i, size=n) for i, (t, n) in
             enumerate([(0.0, 4), (0.1, 4), (0.3, 4), (5.0, 4), (5.1, 3), (5.15, 3), (5.25, 3)])]
    assert abs(pace_s(steps, 4) - 0.15) < 1e-9  # 0.1 and 0.2; the 4.7 s stall left out
    assert abs(pace_s(steps, 3) - 0.075) < 1e-9  # 0.05 and 0.1; the resize's gap (4 -> 3) left out
    assert pace_s(steps, 2) is None


def test_the_reference_pools_the_baseline_with_the_valid_calibrations_only() -> None:
    from benchmarks.harness.goodput import Calibration, reference_step_s

    base = {4: (200, 18.0), 3: (200, 12.0)}  # 90 and 60 ms a step before the soak
    cals = [Calibration(at_s=120.0, size=4, steps=100, s=11.0, valid=True),
            Calibration(at_s=240.0, size=4, steps=100, s=11.0, valid=True),
            Calibration(at_s=360.0, size=4, steps=100, s=50.0, valid=False),  # a recovery in it: not fault-free
            Calibration(at_s=480.0, size=2, steps=100, s=4.0, valid=True)]  # a size the baselines lack
    ref = reference_step_s(base, cals)
    assert ref == pytest.approx({4: 40.0 / 400, 3: 0.06, 2: 0.04})
    assert reference_step_s(base, []) == pytest.approx({4: 0.09, 3: 0.06})
