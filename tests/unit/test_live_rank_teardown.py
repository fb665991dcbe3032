"""An abort tears the rank's group down on a thread of its own (so the gRPC thread that asked
is not held while this rank's compute waits inside the group); the next formation must not run
beside that teardown, which ends torch's default group and resets its group counter. Seen once
under load in the fresh-clone suite: a Reform 0.5 s after the Abort failed with torch's "The
specified group name has already been created" (test_control's abort test). No Ray: the group
and its formation are stand-ins."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from zero_ray.collective.collective_api import SoloGroup
from zero_ray.errors import CollectiveError
from zero_ray.owner.service import live_rank
from zero_ray.owner.service.live_rank import GroupSettings, LiveRank


class SlowTeardown:
    """The aborted group: its teardown ends only when ``release`` is set."""

    def __init__(self, order: list[str]) -> None:
        self.release = threading.Event()
        self._order = order
        self.calls = 0  # teardowns begun

    def abort(self) -> None:
        self.calls += 1
        self.release.wait(10.0)
        self._order.append("torn down")


def _rank(monkeypatch: pytest.MonkeyPatch, order: list[str]) -> tuple[LiveRank, SlowTeardown]:
    def form_group(**_: Any) -> SoloGroup:
        order.append("formed")
        return SoloGroup()

    monkeypatch.setattr(live_rank, "form_group", form_group)
    monkeypatch.setattr(live_rank, "setup_device", lambda **_: None)
    settings = GroupSettings(backend="gloo", group_prefix="test", collective_timeout_s=5.0, settle_timeout_s=0.3,
                             snapshot_every=0)
    rank = LiveRank(rank=0, world_size=2, spec=SimpleNamespace(device="cpu"), settings=settings)  # type: ignore[arg-type]
    old = SlowTeardown(order)
    rank._group = old  # type: ignore[assignment]
    assert rank.abort(reason="a peer failed", generation=0) is False  # idle: no step was in flight
    rank.generation = 1
    return rank, old


def test_a_formation_waits_for_the_aborted_groups_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    rank, old = _rank(monkeypatch, order)
    old.release.set()
    rank._join()
    assert order == ["torn down", "formed"]


def test_a_teardown_that_does_not_end_refuses_the_formation(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    rank, old = _rank(monkeypatch, order)
    try:
        with pytest.raises(CollectiveError, match=r"rank 0: the last group's teardown did not end within "
                                                  r"settle_timeout_s=0.3s; generation 1 cannot form"):
            rank._join()
        assert order == []  # nothing formed beside the teardown
    finally:
        old.release.set()


def test_a_second_abort_of_the_same_group_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under starvation a rank takes two aborts of one generation (the tree's call to its subtree
    outlived its deadline, then the driver's direct one: RelayPlane.abort): the second starts no
    second teardown, so the formation still waits for the first."""
    order: list[str] = []
    rank, old = _rank(monkeypatch, order)
    rank.generation = 0  # the second abort arrives before any re-forming
    first = rank._teardown
    assert rank.abort(reason="the direct abort", generation=0) is False
    assert rank._teardown is first
    rank.generation = 1
    formed = threading.Thread(target=rank._join)
    formed.start()
    old.release.set()
    formed.join(10.0)
    assert (old.calls, order) == (1, ["torn down", "formed"])
