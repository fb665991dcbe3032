"""Replacements started ahead in a detached run (issue 46): standby until a grow takes them in,
never counted pool members by an attaching driver, and not taken once they may have ended
themselves. The pure parts, in milliseconds: no Ray cluster."""

from __future__ import annotations

import time

import pytest

from zero_ray.control.handlers import OwnerStatus
from zero_ray.driver import replacements as repl
from zero_ray.driver.attach import complete, started_ahead
from zero_ray.driver.owner_names import owner_name
from zero_ray.owner.service.owner_control import DriverContact


def _status(rank: int, world_size: int, *, standby: bool = False) -> OwnerStatus:
    return OwnerStatus(rank=rank, world_size=world_size, detached=True, standby=standby)


def test_started_ahead_is_read_from_the_name_the_pool_gives_replacements() -> None:
    assert started_ahead(owner_name("ab12", 2, 5, start=3))
    assert not started_ahead(owner_name("ab12", 2, 5))
    assert not started_ahead("zero_ray-ab12-rank2-g5-x3")  # not an owner's name at all
    assert not started_ahead("someone-else-rank2-g5-s3")


@pytest.mark.parametrize(("ranks_sizes", "whole"), [
    ([(0, 2), (1, 2)], True),
    ([(1, 2), (0, 2)], True),  # in any order
    ([(0, 2)], False),  # rank 1 is a taken-in replacement: ask the started-ahead ones
    ([(0, 1), (1, 2)], False),  # mixed world sizes: a grow cut short
    ([(0, 3), (1, 3), (2, 3), (2, 3)], False),  # a rank twice
    ([], False),  # every member may be a taken-in replacement
])
def test_complete_says_when_no_rank_is_left_for_a_replacement(ranks_sizes: list[tuple[int, int]],
                                                             whole: bool) -> None:
    assert complete([_status(r, w) for r, w in ranks_sizes]) is whole


def test_a_membership_operation_takes_a_standby_owner_in() -> None:
    contact = DriverContact(standby=True)
    before = contact.last
    assert contact.standby
    contact.touch()  # a heartbeat after the driver connected it: still not a member
    assert contact.standby
    contact.take_in()
    assert not contact.standby and contact.last >= before
    assert not DriverContact().standby  # an owner started with its pool is a member from the start


def test_started_owners_go_stale_only_with_a_bound() -> None:
    now = time.monotonic()
    kept = repl.Started(ranks=range(1, 2), world_size=2, actors=[], answers=[], since=now - 100.0)
    assert not kept.stale(now)  # attached run: no bound
    bounded = repl.Started(ranks=range(1, 2), world_size=2, actors=[], answers=[], since=now - 10.0, keep_s=30.0)
    assert not bounded.stale(now) and bounded.stale(now + 20.5)


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    ended: list[object] = []
    monkeypatch.setattr(repl.ray, "kill", lambda actor, no_restart: ended.append(actor))
    return ended


def test_take_hands_over_fresh_replacements_and_ends_stale_ones(killed: list[object]) -> None:
    fresh = repl.Replacements()
    fresh.started = repl.Started(ranks=range(2, 4), world_size=4, actors=["a2", "a3"], answers=[],
                                 since=time.monotonic(), keep_s=60.0)
    assert fresh.take(range(2, 3)) == ["a2"] and killed == ["a3"]  # the grow adds one: the other ends
    killed.clear()
    stale = repl.Replacements()
    stale.started = repl.Started(ranks=range(2, 4), world_size=4, actors=["b2", "b3"], answers=[],
                                 since=time.monotonic() - 61.0, keep_s=60.0)
    assert stale.slots == 2
    assert stale.take(range(2, 4)) == [] and killed == ["b2", "b3"]  # the grow starts owners afresh
    assert stale.started is None and stale.slots == 0


def test_ready_ends_stale_replacements_instead_of_reporting_them(killed: list[object]) -> None:
    stale = repl.Replacements()
    stale.started = repl.Started(ranks=range(1, 2), world_size=2, actors=["c1"], answers=[],
                                 since=time.monotonic() - 5.0, keep_s=4.0)
    assert not stale.ready() and killed == ["c1"] and stale.started is None
    assert not stale.expired(0.0)  # nothing left to time out
