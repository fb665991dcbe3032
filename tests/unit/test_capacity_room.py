"""Start-up's wait for room (core/capacity.py): how many owners the live nodes hold, when the wait
stops, logs or gives up, and what the error at the bound says. Pure: no Ray, the clock passed in."""

from __future__ import annotations

import pytest

from zero_ray.core.capacity import REPORT_EVERY_S, CapacityWait, Room, Verdict, owners_fit, room
from zero_ray.errors import ResourceError

CPU = {"CPU": 1.0}
GPU = {"GPU": 1.0, "CPU": 1.0}


def test_owners_fit_a_node_by_its_scarcest_resource() -> None:
    assert owners_fit({"CPU": 8.0, "GPU": 2.0}, GPU) == 2
    assert owners_fit({"CPU": 8.0}, GPU) == 0  # a CPU node holds no CUDA owner
    assert owners_fit({"CPU": 0.0, "GPU": 0.0}, GPU) == 0  # KubeRay's head: no logical CPUs or GPUs
    assert owners_fit({"CPU": 3.0}, {"CPU": 1.5}) == 2
    assert owners_fit({"CPU": 0.3 * 3}, {"CPU": 0.3}) == 3  # float sums are not short by an ulp
    with pytest.raises(ResourceError, match="asks for nothing"):
        owners_fit({"CPU": 1.0}, {"CPU": 0.0})


def test_room_is_counted_node_by_node() -> None:
    # 3 CPUs in all, but no node has 2 for a 2-CPU owner but one: a slot is never split across nodes.
    r = room(owners=2, demand={"CPU": 2.0}, nodes=[{"CPU": 2.0}, {"CPU": 1.0}], free={"CPU": 3.0, "memory": 9.0})
    assert (r.holds, r.missing) == (1, 1)
    assert r.total == {"CPU": 3.0} and r.free == {"CPU": 3.0}  # only the demanded resources
    assert room(owners=2, demand=CPU, nodes=[{"CPU": 1.0}, {"CPU": 1.0}], free={}).missing == 0
    assert room(owners=1, demand=GPU, nodes=[], free={}).missing == 1  # no live node at all


def test_the_wait_reports_at_once_then_at_a_bounded_rate_and_stops_when_room_appears() -> None:
    short = room(owners=2, demand=CPU, nodes=[{"CPU": 1.0}], free={"CPU": 0.0})
    enough = room(owners=2, demand=CPU, nodes=[{"CPU": 1.0}, {"CPU": 1.0}], free={"CPU": 1.0})
    wait = CapacityWait(bound_s=100.0, started_s=1000.0)
    assert wait.check(short, 1000.0) is Verdict.REPORT  # the first look logs what it waits for
    assert wait.check(short, 1000.0 + REPORT_EVERY_S - 1) is Verdict.WAIT
    assert wait.check(short, 1000.0 + REPORT_EVERY_S) is Verdict.REPORT
    assert wait.check(short, 1000.0 + REPORT_EVERY_S + 1) is Verdict.WAIT
    assert wait.check(enough, 1000.0 + 99.0) is Verdict.READY


def test_no_wait_when_the_nodes_hold_every_owner_even_past_the_bound() -> None:
    enough = room(owners=1, demand=CPU, nodes=[{"CPU": 1.0}], free={"CPU": 0.0})  # held by others: room still
    assert CapacityWait(bound_s=0.0, started_s=0.0).check(enough, 5.0) is Verdict.READY


def test_at_the_bound_the_error_names_what_is_missing_the_bound_and_the_fix() -> None:
    short = room(owners=2, demand=GPU, nodes=[{"CPU": 8.0, "GPU": 1.0}, {"CPU": 4.0}], free={"CPU": 11.0, "GPU": 0.0})
    wait = CapacityWait(bound_s=30.0, started_s=0.0)
    assert wait.check(short, 29.9) is Verdict.REPORT
    with pytest.raises(ResourceError) as caught:
        wait.check(short, 30.0)
    text = str(caught.value)
    assert "lacked 1 more owner slot after waiting capacity_timeout_s=30s" in text
    assert "2 owners need {'GPU': 1, 'CPU': 1} each; the cluster's live nodes hold 1" in text
    assert "they have {'GPU': 1, 'CPU': 12}, {'GPU': 0, 'CPU': 11} free" in text
    assert "add GPU nodes" in text and "device='cpu'" in text and "raise capacity_timeout_s" in text
    cpu = room(owners=3, demand=CPU, nodes=[{"CPU": 1.0}], free={"CPU": 1.0}).error(bound_s=0.0)
    assert "lacked 2 more owner slots" in str(cpu) and "num_cpus_per_owner" in str(cpu)


def test_a_bound_of_zero_fails_at_once() -> None:
    short = room(owners=2, demand=CPU, nodes=[{"CPU": 1.0}], free={"CPU": 1.0})
    with pytest.raises(ResourceError, match="capacity_timeout_s=0s"):
        CapacityWait(bound_s=0.0, started_s=7.0).check(short, 7.0)


def test_the_waiting_line_says_what_it_waits_for() -> None:
    line = Room(owners=2, demand=CPU, holds=1, total={"CPU": 1.0}, free={"CPU": 0.0}).waiting(waited_s=12.4,
                                                                                            bound_s=600.0)
    assert line.startswith("waiting for 1 more owner slot: 2 owners need {'CPU': 1} each; the cluster's live "
                           "nodes hold 1 (they have {'CPU': 1}, {'CPU': 0} free); 12s of up to "
                           "capacity_timeout_s=600s")


def test_the_bound_is_a_finite_number_of_seconds_zero_allowed() -> None:
    import math

    from zero_ray.config import ZeroConfig
    from zero_ray.errors import ConfigError

    assert ZeroConfig().capacity_timeout_s == 600.0
    assert ZeroConfig(capacity_timeout_s=0).capacity_timeout_s == 0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="capacity_timeout_s=.* must be a finite number of seconds >= 0"):
            ZeroConfig(capacity_timeout_s=bad)
