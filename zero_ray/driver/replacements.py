"""Replacement owners started ahead of the grow that takes them in.

After a loss the run continues on the survivors at once (``ElasticConfig.continue_on_survivors``)
while replacements start: an owner's start (a Ray worker process, then importing torch) takes
seconds (measured 3.8-4.2 s on a 2-core machine), which the next step then does not wait for.
They join at the first step boundary at which every one of them answers, as a grow
(``OwnerPool.resize``). They are for one pool size: a pool that changes any other way first, or
shuts down, ends them, as does a start that has not answered within the start-up timeout.
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


class Replacements:
    """At most one set of owners started for a later grow."""

    def __init__(self) -> None:
        self.started: Started | None = None

    def start(self, ranks: range, world_size: int, launch: Callable[[range, int], list[Any]]) -> None:
        """Start owners for ``ranks`` of a ``world_size``-owner pool with ``launch`` (which only
        creates the actors); returns at once."""
        self.discard()
        actors = launch(ranks, world_size)
        self.started = Started(ranks=ranks, world_size=world_size, actors=actors,
                               answers=[a.node.remote() for a in actors], since=time.monotonic())

    def ready(self) -> bool:
        """Whether every started owner has answered (without waiting)."""
        if self.started is None:
            return False
        done, _ = ray.wait(self.started.answers, num_returns=len(self.started.answers), timeout=0)
        return len(done) == len(self.started.answers)

    def expired(self, timeout_s: float) -> bool:
        """Started more than ``timeout_s`` ago and still not all answering (no room after all)."""
        return self.started is not None and time.monotonic() - self.started.since > timeout_s and not self.ready()

    def held(self, ranks: range, world_size: int) -> int:
        """How many of the owners a grow to ``ranks`` of ``world_size`` needs are already started
        (and hold their slots)."""
        return len(self.started.actors) if self.matches(ranks, world_size) else 0

    def matches(self, ranks: range, world_size: int) -> bool:
        return self.started is not None and (self.started.ranks, self.started.world_size) == (ranks, world_size)

    def take(self, ranks: range, world_size: int) -> list[Any] | None:
        """The started owners when they are the ones a grow to ``ranks`` of ``world_size`` needs
        (they are the caller's now), else None, having ended any others."""
        if not self.matches(ranks, world_size):
            self.discard()
            return None
        assert self.started is not None
        actors, self.started = self.started.actors, None
        return actors

    def discard(self) -> bool:
        """End the started owners, if any; returns whether there were some."""
        if self.started is None:
            return False
        for actor in self.started.actors:
            ray.kill(actor, no_restart=True)
        self.started = None
        return True
