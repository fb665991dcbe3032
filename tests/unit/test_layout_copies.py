"""Peer copies across a resize or restore (owner/resilience/redundancy.PeerSnapshots): the old layout's stay
until the new layout's are confirmed, and a loss in between finds one complete set."""

from __future__ import annotations

from typing import Any

import pytest

from zero_ray.owner.resilience.redundancy import PeerSnapshots


def _with_old_layout() -> PeerSnapshots:
    snaps = PeerSnapshots()
    snaps.own, snaps.ward = "old own", "old ward"  # type: ignore[assignment]

    def take(*args: Any, **kwargs: Any) -> int:  # the exchange itself is the collective tier's
        snaps.pending = ("new own", "new ward")  # type: ignore[assignment]
        return 0

    snaps.take = take  # type: ignore[method-assign]
    snaps.take_layout(None, None, step=4, backup=2, ward=0, timeout_s=1.0)  # type: ignore[arg-type]
    return snaps


def _held(snaps: PeerSnapshots) -> tuple[Any, Any]:
    return snaps.own, snaps.ward


def test_the_new_layout_copies_wait_beside_the_old_ones_until_confirmed() -> None:
    snaps = _with_old_layout()
    assert _held(snaps) == ("old own", "old ward")
    assert snaps.confirm_layout(2, 0) is True
    assert _held(snaps) == ("new own", "new ward")


def test_copies_sent_to_other_peers_are_not_confirmed() -> None:
    snaps = _with_old_layout()
    assert snaps.confirm_layout(1, 0) is False
    assert _held(snaps) == ("old own", "old ward")
    assert snaps.confirm_layout(2, 0) is False  # dropped, not kept for later


def test_a_loss_inside_the_transfer_keeps_the_old_layout() -> None:
    snaps = _with_old_layout()
    assert snaps.settle_layout(complete=False) is None
    assert _held(snaps) == ("old own", "old ward")


@pytest.mark.parametrize("confirmed_first", [False, True])
def test_a_loss_while_confirming_keeps_the_new_layout_on_every_owner(confirmed_first: bool) -> None:
    snaps = _with_old_layout()
    if confirmed_first:  # SetPeers reached this owner before the loss
        snaps.confirm_layout(2, 0)
    peers = snaps.settle_layout(complete=True)
    assert peers == (None if confirmed_first else (2, 0))
    assert _held(snaps) == ("new own", "new ward")


def test_an_owner_without_new_copies_holds_none_once_the_transfer_completed() -> None:
    surplus = PeerSnapshots()  # a shrink's surplus owner: it took no copy of the new layout
    surplus.own, surplus.ward = "old own", "old ward"  # type: ignore[assignment]
    assert surplus.settle_layout(complete=True) is None
    assert _held(surplus) == (None, None)  # its old-layout copies no longer match any rank's state
