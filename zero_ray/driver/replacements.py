"""Replacement owners started ahead of the grow that takes them in.

After a loss the run continues on the survivors at once (``ElasticConfig.continue_on_survivors``)
while replacements start: an owner's start (a Ray worker process, then importing torch, and
torch.optim's lazy imports, which the grow would otherwise wait for: ``actor.prepare_process``)
takes seconds (measured 3.8-4.2 s on a 2-core machine; 3.7-5.9 s at load 7-12 with those
imports), which the next step then does not wait for.
They join at the first step boundary at which every one of them answers, as a grow
(``OwnerPool.resize``). The next membership change takes them in or ends them: a grow or a
rebuild adding owners from the same rank takes as many as it adds (ending the rest), any other
change ends them, and so do a shutdown and a start that has not answered within the start-up
timeout. Their slots therefore count as room for that change (``slots``): a resize or restore
while they start sees the room the cluster will have, not the room they hold.

In a detached run they are detached too (once taken in they are members, which outlive the
driver), but started as standby owners (``OwnerOptions.standby``): until a grow's membership
operation reaches them their Status says so, and a driver attaching after this one's loss ends
them instead of counting them members (``driver/attach.py``). No driver speaks to them before
that, so each ends itself ``orphan_timeout_s`` after its start unless taken in; the driver
therefore takes them only within ``keep_s`` of their start (half that bound), ending them after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(kw_only=True)
class Started:
    """Owners for ``ranks`` of a ``world_size``-owner pool, started at ``since`` (monotonic)."""

    ranks: range
    world_size: int
    actors: list[Any]
    answers: list[ray.ObjectRef]  # each actor's ``node`` call: ready once it has started
    since: float
    keep_s: float | None = None  # taken only this long after ``since`` (they end themselves later)

    def stale(self, now: float) -> bool:
        """Too old to take in: they may end themselves before the grow reaches them."""
        return self.keep_s is not None and now - self.since > self.keep_s


class Replacements:
    """At most one set of owners started for a later grow."""

    def __init__(self) -> None:
        self.started: Started | None = None

    def start(self, ranks: range, world_size: int, launch: Callable[[range, int], list[Any]], *,
              keep_s: float | None = None) -> None:
        """Start owners for ``ranks`` of a ``world_size``-owner pool with ``launch`` (which only
        creates the actors); returns at once. With ``keep_s`` (a detached run's standby owners)
        they are ended rather than taken in once that long has passed since their start."""
        self.discard()
        actors = launch(ranks, world_size)
        self.started = Started(ranks=ranks, world_size=world_size, actors=actors,
                               answers=[a.node.remote() for a in actors], since=time.monotonic(), keep_s=keep_s)

    def ready(self) -> bool:
        """Whether every started owner has answered (without waiting). Stale ones (``keep_s``)
        are ended here: a later grow starts owners afresh."""
        if self.started is None:
            return False
        if self.started.stale(time.monotonic()):
            self.discard()
            return False
        done, _ = ray.wait(self.started.answers, num_returns=len(self.started.answers), timeout=0)
        return len(done) == len(self.started.answers)

    def expired(self, timeout_s: float) -> bool:
        """Started more than ``timeout_s`` ago and still not all answering (no room after all)."""
        return self.started is not None and time.monotonic() - self.started.since > timeout_s and not self.ready()

    @property
    def slots(self) -> int:
        """How many slots the started owners hold: the next membership change takes them in or
        ends them, so they count as room for it."""
        return len(self.started.actors) if self.started is not None else 0

    def take(self, ranks: range) -> list[Any]:
        """The started owners a change adding ``ranks`` can take in (they are the caller's now):
        those of the ranks both share, when both begin at the same rank (replacements are started
        for the ranks just past the pool's size, and an owner's rank is fixed at its start). Every
        other started owner is ended, its slot going back to the cluster."""
        started, self.started = self.started, None
        if started is None:
            return []
        keep = min(len(started.ranks), len(ranks)) if started.ranks.start == ranks.start else 0
        if started.stale(time.monotonic()):
            keep = 0
        for actor in started.actors[keep:]:
            ray.kill(actor, no_restart=True)
        return started.actors[:keep]

    def discard(self) -> bool:
        """End the started owners, if any; returns whether there were some."""
        if self.started is None:
            return False
        for actor in self.started.actors:
            ray.kill(actor, no_restart=True)
        self.started = None
        return True
