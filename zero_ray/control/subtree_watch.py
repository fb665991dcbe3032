"""The health of every rank under some children of the relay tree, read on one asyncio loop
thread (issue 44, "health per node"): the caller's side of the ``Relay.Watch`` stream.

A :class:`SubtreeReader` is given the children it watches, as a relay hop is given the children
it calls (control/relay_hop.py): owners (:class:`OwnerChild`: their ``PartitionOwner.Health``
stream) and relays (:class:`RelayChild`: their ``Relay.Watch`` stream, one for every rank under
the relay). Every stream is a task on one loop thread (control/heartbeats.py's
:class:`StreamReader`), and every report is per rank, as :class:`HeartbeatReader` reports:

- ``on_beat(rank, beat)``: a rank is alive. An owner's each beat; under a relay, every rank it
  still watches, once for each of its messages (a message names only the beats that changed; the
  others are the last ones it sent, and alive as of that message).
- ``on_lost(rank, reason)``, once: the rank itself is lost. Its owner's stream failed, ended or
  sent nothing for ``stall_s`` (a relay reports that of its ranks at once, with the reason it
  saw); or the rank's process runs a relay whose own Watch stream failed, ended or stalled: a
  relay runs in the process of the lowest rank under it (core/relay_tree.py), so its loss is
  that owner's.
- ``on_unwatched(rank, reason)``, once: a relay between the rank and the caller is lost, and
  with it all that is known of the rank; the reason starts with :data:`RELAY_LOST`. Such a rank
  is not counted lost: its process most likely lives (a relay's SIGKILL takes one owner, not
  eight) and killing it as lost would cost the run its state for nothing. It is not orphaned
  either: its relay's host is reported lost in the same breath, and the driver's recovery after
  any loss re-plans the tree (``RelayTree.reparent``) and watches the ranks again.

The caller's CPU is per relay message, not per rank beat: the driver watching 16 node relays
instead of 128 owners decodes 16 messages an interval instead of 128
(``python -m benchmarks.relay_health``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from zero_ray.control._generated import relay_pb2, relay_pb2_grpc
from zero_ray.control.client_channel import ClientConfig, check_timeout, header_of
from zero_ray.control.handlers import Heartbeat
from zero_ray.control.heartbeats import OnBeat, OnLost, StreamReader, StreamTarget, health_target, heartbeat_of
from zero_ray.control.relay_hop import HopChild, OwnerChild, RelayChild
from zero_ray.errors import ConfigError

__all__ = ["OnUnwatched", "RELAY_LOST", "SubtreeReader", "watch_target"]

OnUnwatched = Callable[[int, str], None]

# How an unwatched rank's reason starts: a relay above it is lost, not (as far as is known) the rank.
RELAY_LOST = "relay lost"


def watch_target(config: ClientConfig, *, relay: int, interval_s: float, stall_s: float) -> StreamTarget:
    """Relay ``relay``'s ``Relay.Watch`` stream (its process may serve several): a message every
    ``interval_s``, its children counted lost after ``stall_s`` of silence."""
    request = relay_pb2.WatchRequest(header=header_of(config), interval_ms=max(1, round(interval_s * 1000)),
                                     stall_ms=max(1, round(stall_s * 1000)), relay=relay)
    return StreamTarget(config=config, operation="Relay.Watch", request=request,
                        rpc=lambda channel: relay_pb2_grpc.RelayStub(channel).Watch)


class SubtreeReader:
    """Reads every child's stream (an owner's Health, a relay's Watch) on one loop thread and
    reports per rank: ``on_beat``, ``on_lost``, ``on_unwatched`` (see the module's docstring;
    all on the reader's thread: keep them short). ``close()`` ends every stream without reporting
    losses."""

    _children: tuple[HopChild, ...]
    _under: tuple[frozenset[int], ...]  # the ranks under each child
    _beats: tuple[dict[int, Heartbeat], ...]  # per relay child: the last beat of each rank it still watches
    _done: tuple[set[int], ...]  # per child: the ranks reported lost or unwatched
    _on_beat: OnBeat
    _on_lost: OnLost
    _on_unwatched: OnUnwatched
    _streams: StreamReader

    def __init__(self, children: Sequence[HopChild], *, interval_s: float, stall_s: float, on_beat: OnBeat,
                 on_lost: OnLost, on_unwatched: OnUnwatched) -> None:
        check_timeout("interval_s", interval_s)
        check_timeout("stall_s", stall_s)
        if not interval_s < stall_s:
            raise ConfigError(f"interval_s={interval_s} must be below stall_s={stall_s}: a child beating every "
                              "interval would otherwise be counted stalled")
        ranks = [r for c in children for r in c.ranks]
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"the watched children share ranks ({sorted(ranks)}): each rank is under one child")
        self._children = tuple(children)
        self._under = tuple(frozenset(c.ranks) for c in self._children)
        self._beats = tuple({} for _ in self._children)
        self._done = tuple(set() for _ in self._children)
        self._on_beat, self._on_lost, self._on_unwatched = on_beat, on_lost, on_unwatched
        targets = [health_target(c.client.config, interval_s) if isinstance(c, OwnerChild)
                   else watch_target(c.client.config, relay=c.relay, interval_s=interval_s, stall_s=stall_s)
                   for c in self._children]
        self._streams = StreamReader(targets, stall_s=stall_s, on_message=self._message, on_lost=self._child_lost,
                                     name="subtree-watch")

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank watched, ascending."""
        return tuple(sorted(r for c in self._children for r in c.ranks))

    def _message(self, index: int, message: Any) -> None:
        child = self._children[index]
        if isinstance(child, OwnerChild):  # the rank is the tree's, not what the owner's beat claims
            self._on_beat(child.rank, heartbeat_of(message))
            return
        under, beats, done = self._under[index], self._beats[index], self._done[index]
        for beat in message.beats:
            if beat.rank in under and beat.rank not in done:
                beats[beat.rank] = heartbeat_of(beat)
        for loss in message.lost:
            if loss.rank in under and loss.rank not in done:
                done.add(loss.rank)
                beats.pop(loss.rank, None)
                (self._on_unwatched if loss.unwatched else self._on_lost)(loss.rank, loss.reason)
        for rank, beat in beats.items():
            self._on_beat(rank, beat)

    def _child_lost(self, index: int, reason: str) -> None:
        child = self._children[index]
        if isinstance(child, OwnerChild):
            self._on_lost(child.rank, reason)
            return
        self._relay_lost(index, child, reason)

    def _relay_lost(self, index: int, child: RelayChild, reason: str) -> None:
        done = self._done[index]
        self._beats[index].clear()
        if child.host not in done:
            self._on_lost(child.host, f"{reason}; the relay ran in rank {child.host}'s process on {child.node}")
        for rank in child.ranks:
            if rank != child.host and rank not in done:
                self._on_unwatched(rank, f"{RELAY_LOST}: the relay in rank {child.host}'s process on {child.node}, "
                                         f"which watched rank {rank}, is lost ({reason}); rank {rank}'s own state "
                                         "is unknown until a re-planned tree watches it again")
        done.update(child.ranks)

    def close(self) -> None:
        """End every stream (no report follows this) and the reader's thread."""
        self._streams.close()
