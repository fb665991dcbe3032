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
