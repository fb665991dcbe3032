"""Replacements started ahead in a detached run (issue 46): standby until a grow takes them in,
never counted pool members by an attaching driver, and not taken once they may have ended
themselves. The pure parts, in milliseconds: no Ray cluster."""

from __future__ import annotations

import time
from types import SimpleNamespace

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


class _Handle:
    """An owner actor's handle: its ``node`` call's reference is its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.node = SimpleNamespace(remote=lambda: name)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """attach's Ray and gRPC reads over a table of owners: name -> Status, or None (not answering)."""
    from zero_ray.driver import attach

    state: dict[str, object] = {"owners": {}, "ended": []}
    owners: dict[str, OwnerStatus | None] = state["owners"]  # type: ignore[assignment]

    def statuses(names: list[str], *, timeout_s: float) -> tuple[list[tuple[object, OwnerStatus]], None]:
        assert all(owners[n] is not None for n in names), "asked an owner that does not answer"
        return [(_Handle(n), owners[n]) for n in names], None  # type: ignore[misc]

    monkeypatch.setattr(attach, "_statuses", statuses)
    monkeypatch.setattr(attach, "_handles", lambda names: {n: _Handle(n) for n in names if n in owners})
    monkeypatch.setattr(attach, "_answered", lambda ref: True)

    class FakeRay:
        @staticmethod
        def wait(refs: list[str], *, num_returns: int, timeout: float) -> tuple[list[str], list[str]]:
            return [r for r in refs if owners[r] is not None], [r for r in refs if owners[r] is None]

        @staticmethod
        def kill(handle: _Handle, no_restart: bool) -> None:
            state["ended"].append(handle.name)  # type: ignore[attr-defined]

    monkeypatch.setattr(attach, "ray", FakeRay)
    return state


def _named(rank: int, start: int = 0) -> str:
    return owner_name("ab12", rank, 1, start=start)


def test_attach_ends_standby_owners_beside_a_whole_pool_without_asking_them(cluster: dict[str, object]) -> None:
    from zero_ray.driver.attach import _members

    cluster["owners"].update({_named(0): _status(0, 2), _named(1): _status(1, 2),  # type: ignore[attr-defined]
                              _named(2, start=1): None})  # still starting (or waiting for room)
    owners, _ = _members(sorted(cluster["owners"]), timeout_s=1.0, end_others=True)  # type: ignore[arg-type]
    assert sorted(s.rank for _, s in owners) == [0, 1]
    assert cluster["ended"] == [_named(2, start=1)]


def test_attach_keeps_taken_in_replacements_and_ends_the_rest(cluster: dict[str, object]) -> None:
    from zero_ray.driver.attach import _members

    cluster["owners"].update({  # type: ignore[attr-defined]
        _named(0): _status(0, 3), _named(1): _status(1, 3),
        _named(2, start=1): _status(2, 3),  # a grow took it in
        _named(3, start=2): _status(3, 4, standby=True),  # started after a later loss, never taken in
        _named(4, start=2): None,  # not answering
    })
    owners, _ = _members(sorted(cluster["owners"]), timeout_s=1.0, end_others=True)  # type: ignore[arg-type]
    assert sorted(s.rank for _, s in owners) == [0, 1, 2]
    assert sorted(cluster["ended"]) == [_named(3, start=2), _named(4, start=2)]  # type: ignore[arg-type]
    cluster["ended"].clear()  # type: ignore[attr-defined]
    listed, _ = _members(sorted(cluster["owners"]), timeout_s=1.0, end_others=False)  # type: ignore[arg-type]
    assert len(listed) == 3 and cluster["ended"] == []  # `zero-ray status` lists, ends nothing
