"""The soak's fault schedule (benchmarks/harness/soak_faults.py): seeded, about one fault an
interval, every kind once a round, none in the last half interval (so each has time to land)."""

from __future__ import annotations

from benchmarks.harness.soak_faults import KINDS, schedule


def test_the_schedule_is_a_function_of_its_seed_and_covers_every_kind_each_round() -> None:
    plan = schedule(seed=46, duration_s=1800, interval_s=60)
    assert plan == schedule(seed=46, duration_s=1800, interval_s=60)
    assert plan != schedule(seed=47, duration_s=1800, interval_s=60)
    assert len(plan) == 29  # at 60, 120, ... 1740 s: 1770 would leave under half an interval
    times = [p.at_s for p in plan]
    assert times == sorted(times) and times[0] >= 45 and times[-1] < 1800 - 30
    assert all(30 <= b - a <= 90 for a, b in zip(times, times[1:]))  # each time jittered by a quarter interval
    for r in range(len(plan) // len(KINDS)):
        assert sorted(p.kind for p in plan[r * len(KINDS):(r + 1) * len(KINDS)]) == sorted(KINDS)


def test_a_subset_of_kinds_is_drawn_from_alone() -> None:
    plan = schedule(seed=1, duration_s=600, interval_s=20, kinds=("resize",))
    assert {p.kind for p in plan} == {"resize"} and len(plan) == 29


def test_every_kind_has_its_injector_and_the_new_kinds_are_drawn() -> None:
    from benchmarks.harness.soak_faults import FULL_DISK, NODE_KILLED, NOT_INJECTED, Injector

    assert {NODE_KILLED, FULL_DISK} <= set(KINDS) and not set(KINDS) & set(NOT_INJECTED)
    assert all(callable(getattr(Injector, f"_{kind}", None)) for kind in KINDS)


class _Trainer:
    world_size = 4


def test_a_fault_held_past_overdue_s_is_recorded_as_missed_not_silence() -> None:
    """The 30-minute soak's stall: the run at 4 owners, the injector keeping 3, nothing fired for
    17 minutes and nothing said so. Now each planned fault held past ``overdue_s`` is a record."""
    from benchmarks.harness.soak_faults import Injector, Planned

    plan = [Planned(at_s=10.0, kind="resize"), Planned(at_s=20.0, kind="owner_sigkill")]
    inj = Injector(_Trainer(), cluster=None, plan=plan, seed=1, sizes=(4, 3), short_cut_s=5, long_cut_s=17,
                   degrade_s=20, overdue_s=30.0)
    inj._size = 3  # as resume() left it after the driver's loss
    inj.tick(35.0, step=100)  # due, unsettled, not yet overdue: held
    assert inj.records == [] and len(inj.pending) == 2
    inj.tick(41.0, step=160)  # the first 31 s past its time: missed; the second 21 s: still held
    assert [(r.kind, r.missed, r.fired, r.held_s) for r in inj.records] == [("resize", True, False, 31.0)]
    assert "the run at 4 owners (the injector keeps 3)" in inj.records[0].evidence
    inj.tick(51.0, step=250)
    assert [r.kind for r in inj.records if r.missed] == ["resize", "owner_sigkill"] and inj.pending == []


class _Rule:
    def __init__(self, hits: int) -> None:
        self.hits = hits


def test_calibrations_wait_until_no_fault_is_in_flight() -> None:
    """A calibration is the reference for fault-free steps: never one with a timer still to undo a
    cut, an S3 error rule not yet spent, a check unsettled or the driver's kill asked."""
    import threading

    from benchmarks.harness.soak_faults import S3_ERRORS, Injector

    inj = Injector(_Trainer(), cluster=None, plan=[], seed=1, sizes=(4, 3), short_cut_s=5, long_cut_s=17,
                   degrade_s=20, overdue_s=30.0)
    assert inj.quiet(100.0)
    release = threading.Event()
    timer = threading.Thread(target=release.wait, args=(30,))
    timer.start()
    inj._timers.append(timer)
    assert not inj.quiet(100.0)
    release.set()
    timer.join(timeout=30)
    assert inj.quiet(100.0)
    inj._rules.append((None, _Rule(hits=S3_ERRORS - 1)))
    assert not inj.quiet(100.0)
    inj._rules[-1] = (None, _Rule(hits=S3_ERRORS))
    assert inj.quiet(100.0)
    inj._unsettled.append(lambda: False)
    assert not inj.quiet(100.0)
    inj._unsettled.clear()
    inj._size = 3  # the injector keeps 3, the run is at 4
    assert not inj.quiet(100.0)
    inj._size, inj.kill_requested = 4, True
    assert not inj.quiet(100.0)


def test_a_calibration_waits_for_the_last_fault_to_have_settled_long_enough() -> None:
    from benchmarks.harness.soak_faults import FaultRecord, Injector

    inj = Injector(_Trainer(), cluster=None, plan=[], seed=1, sizes=(4, 3), short_cut_s=5, long_cut_s=17,
                   degrade_s=20, overdue_s=30.0)
    inj.records.append(FaultRecord(kind="owner_sigkill", planned_s=60.0, at_s=60.0, at_step=600))
    assert not inj.quiet(70.0, for_s=20.0)  # settled now (no tick saw it): 20 s from here
    assert inj.records[-1].settled_s == 10.0
    assert not inj.quiet(89.0, for_s=20.0)
    assert inj.quiet(90.0, for_s=20.0)
