"""A relay's side of the ``Relay.Watch`` stream (issue 44, "health per node"): what one caller's
stream sends.

A :class:`WatchFeed` reads the relay's children with a :class:`SubtreeReader` (its own loop
thread, control/subtree_watch.py): a node relay its owners' ``PartitionOwner.Health`` streams, an
upper relay the ``Watch`` streams of the relays below it. Composing the tree this way, rather
than an upper relay (or the driver) reading every owner of its subtree, keeps every reader's
streams at most one fan-out: the driver reads its top relays' streams whatever the number of
owners, a relay its children's. A loss costs one more hop per level (milliseconds: it is pushed,
not polled), and a stall is still detected once, by the reader just above the frozen process,
after ``stall_s``: a relay keeps sending while a child of it is frozen.

Each message (a ``SubtreeBeats``) goes out every ``interval_s``, and at once when a rank is lost:

- ``beats``: the ranks whose latest beat differs from the one last sent in step, state or
  rss_bytes (the owner's timestamp alone is not a change); the first message after a rank's
  first beat names it. The beat's rank is the tree's, set here: the rank an owner claims is not
  trusted to be the rank the relay watches it as.
- ``lost``: each rank lost since the last message, once, with the reason the reader gave
  (``unwatched`` for the ranks under a relay below that was lost, its host rank excepted).

An idle relay's message is then a few bytes, and a stream that sends nothing for ``stall_s`` is
the relay's own loss. The feed ends when the caller cancels or the server stops (then within one
interval: the stream admission's ``finished`` is checked between messages), and closing it closes
its reader.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from zero_ray.control._generated import owner_pb2, relay_pb2
from zero_ray.control.client_channel import check_timeout
from zero_ray.control.conversion import to_message
from zero_ray.control.handlers import Heartbeat
from zero_ray.control.relay_hop import HopChild
from zero_ray.control.subtree_watch import SubtreeReader

__all__ = ["WatchFeed"]


def _changed(beat: Heartbeat, sent: Heartbeat | None) -> bool:
    return sent is None or (beat.step, beat.state, beat.rss_bytes) != (sent.step, sent.state, sent.rss_bytes)


class WatchFeed:
    """One Watch stream's messages at a relay, over its ``children``. :meth:`next` blocks (on
    the server's thread) until the next message is due; the children are read on the reader's
    thread. :meth:`close` ends the reader."""

    _interval_s: float
    _changed_cv: threading.Condition
    _latest: dict[int, Heartbeat]  # every watched rank's last beat
    _sent: dict[int, Heartbeat]  # the beat last sent of each rank
    _losses: list[relay_pb2.RankLoss]  # not sent yet
    _next_at: float
    _reader: SubtreeReader

    def __init__(self, children: Sequence[HopChild], *, interval_s: float, stall_s: float) -> None:
        check_timeout("interval_s", interval_s)
        self._interval_s = interval_s
        self._changed_cv = threading.Condition()
        self._latest, self._sent, self._losses = {}, {}, []
        self._next_at = time.monotonic()  # the first message at once: the caller knows the relay is up
        self._reader = SubtreeReader(children, interval_s=interval_s, stall_s=stall_s, on_beat=self._beat,
                                     on_lost=self._lost, on_unwatched=self._unwatched)

    def _beat(self, rank: int, beat: Heartbeat) -> None:
        if beat.rank != rank:
            beat = dataclasses.replace(beat, rank=rank)
        with self._changed_cv:
            self._latest[rank] = beat

    def _lost(self, rank: int, reason: str) -> None:
        self._push(relay_pb2.RankLoss(rank=rank, reason=reason, unwatched=False))

    def _unwatched(self, rank: int, reason: str) -> None:
        self._push(relay_pb2.RankLoss(rank=rank, reason=reason, unwatched=True))

    def _push(self, loss: relay_pb2.RankLoss) -> None:
        with self._changed_cv:
            self._latest.pop(loss.rank, None)
            self._losses.append(loss)
            self._changed_cv.notify_all()

    def wake(self) -> None:
        """Have :meth:`next` look at ``finished`` now (the call ended)."""
        with self._changed_cv:
            self._changed_cv.notify_all()

    def next(self, finished: threading.Event) -> relay_pb2.SubtreeBeats | None:
        """The next message: at the next interval, or at once when a loss is waiting; None once
        ``finished`` is set."""
        with self._changed_cv:
            while True:
                if finished.is_set():
                    return None
                now = time.monotonic()
                if self._losses or now >= self._next_at:
                    break
                self._changed_cv.wait(self._next_at - now)
            if now >= self._next_at:
                self._next_at = now + self._interval_s
            beats = [(rank, beat) for rank, beat in self._latest.items() if _changed(beat, self._sent.get(rank))]
            for rank, beat in beats:
                self._sent[rank] = beat
            losses, self._losses = self._losses, []
        return relay_pb2.SubtreeBeats(
            beats=[to_message(beat, owner_pb2.Heartbeat) for _, beat in beats], lost=losses)

    def close(self) -> None:
        """End the reader of the children's streams (no loss is reported after this)."""
        self._reader.close()
