"""Health per node through the relay tree (issue 44): the driver's monitor reads the top relays'
(or the node relays') Watch streams, each relay reads the streams below it, and every rank's
beat, state and loss arrives per rank. A stopped owner server and a frozen owner are lost within
their bounds, a stopped relay is its host rank's loss and its other ranks' "relay lost", and
closing reports nothing. In-process gRPC over stand-in owners (tests/control/relay_stand_ins.py)."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from control_fakes import WAIT_S, raw_channel, header
from relay_stand_ins import ServedTree, serve_tree

from zero_ray.control._generated import owner_pb2, relay_pb2, relay_pb2_grpc
from zero_ray.control.auth import Credentials, bearer_metadata
from zero_ray.control.conversion import to_record
from zero_ray.control.handlers import Heartbeat
from zero_ray.control.heartbeats import heartbeat_of
from zero_ray.control.rank_watch import SubtreeHealthMonitor
from zero_ray.control.relay_hop import RelayChild, hop_children
from zero_ray.control.subtree_watch import RELAY_LOST, SubtreeReader
from zero_ray.errors import ConfigError

WORLD = 8
NODES = [f"node-{n}" for n in "abcd" for _ in range(2)]  # four node relays of two ranks, two relays above
INTERVAL_S = 0.05
STALL_S = 0.6
LOSS_BOUND_S = 1.0  # a stopped server's loss, pushed up two relays: well under the 1 s decision


def _tree() -> ServedTree:
    return serve_tree(Credentials(job_id="job-watch", token=secrets.token_urlsafe(32)), NODES, fan_out=2)


@pytest.fixture
def served() -> Iterator[ServedTree]:
    tree = _tree()
    yield tree
    tree.close()


def _top(tree: ServedTree) -> tuple:
    return hop_children(tree.tree, None, owners=tree.owner_clients, relays=tree.relay_clients)


def _node_relays(tree: ServedTree) -> tuple[RelayChild, ...]:
    relays = [tree.tree.node_relay(n) for n in sorted(set(NODES))]
    return tuple(RelayChild(relay=r.id, ranks=r.ranks, host=r.host, node=tree.tree.nodes[r.host],
                            client=tree.relay_clients[r.id])
                 for r in relays)


def _until(predicate: Callable[[], bool], bound_s: float = WAIT_S) -> float:
    """Seconds until ``predicate`` holds, polled; fails past ``bound_s``."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < bound_s, f"not within {bound_s}s"
        time.sleep(0.005)
    return time.monotonic() - began


def _monitor(children: tuple, stall_s: float = STALL_S) -> SubtreeHealthMonitor:
    return SubtreeHealthMonitor(children, interval_s=INTERVAL_S, timeout_s=stall_s)


@pytest.mark.parametrize("level", ["top relays", "node relays"])
def test_beats_flow_per_rank_and_close_reports_nothing(served: ServedTree, level: str) -> None:
    for owner in served.owners:
        owner.beat_state = f"step-{owner.rank}"
    monitor = _monitor(_top(served) if level == "top relays" else _node_relays(served))
    try:
        _until(lambda: all(h.state == f"step-{h.rank}" for h in monitor.snapshot()))
        seen = monitor.snapshot()
        assert [h.rank for h in seen] == list(range(WORLD))
        assert [h.rss_bytes for h in seen] == [(r + 1) << 20 for r in range(WORLD)]
        assert all(h.healthy and h.last_beat > 0 for h in seen)
        # The beats keep coming: every rank's last beat moves on, not only the changed ones'.
        first = {h.rank: h.last_beat for h in seen}
        _until(lambda: all(h.last_beat > first[h.rank] for h in monitor.snapshot()))
        served.owners[6].beat_state = "saving"
        _until(lambda: monitor.snapshot()[6].state == "saving")
    finally:
        monitor.close()
    for server in served.servers:  # what ends after close() is not reported
        server.stop(0.0)
    assert monitor.lost() == {} and monitor.unwatched() == {}


def test_a_stopped_owner_is_lost_within_the_bound(served: ServedTree) -> None:
    monitor = _monitor(_top(served))
    try:
        _until(lambda: all(h.last_beat > 0 for h in monitor.snapshot()))
        served.servers[5].stop(0.0)  # rank 5's owner server (the owners' servers come first)
        took = _until(lambda: 5 in monitor.lost(), LOSS_BOUND_S)
        assert "PartitionOwner.Health" in monitor.lost()[5], monitor.lost()[5]
        assert took < LOSS_BOUND_S
        assert set(monitor.lost()) == {5} and monitor.unwatched() == {}
        assert [h.rank for h in monitor.snapshot() if not h.healthy] == [5]
    finally:
        monitor.close()


def test_a_frozen_owner_is_lost_after_stall_s(served: ServedTree) -> None:
    hang = threading.Event()
    monitor = _monitor(_top(served))
    try:
        _until(lambda: all(h.last_beat > 0 for h in monitor.snapshot()))
        began = time.monotonic()
        served.owners[2].hang_heartbeats = hang  # its next beat never comes; its server still answers
        _until(lambda: 2 in monitor.lost())
        took = time.monotonic() - began
        assert STALL_S - INTERVAL_S <= took < STALL_S + 1.0, took
        assert f"sent nothing for {STALL_S:g}s" in monitor.lost()[2]
        # The relays above it kept sending while it was frozen: no one else counted stalled.
        assert set(monitor.lost()) == {2} and monitor.unwatched() == {}
    finally:
        hang.set()
        monitor.close()


@pytest.mark.parametrize("level", ["top relays", "node relays"])
def test_a_stopped_relay_is_its_hosts_loss_and_its_other_ranks_are_unwatched(served: ServedTree,
                                                                            level: str) -> None:
    node_c = served.tree.node_relay("node-c")
    assert node_c.ranks == (4, 5) and node_c.host == 4
    monitor = _monitor(_top(served) if level == "top relays" else _node_relays(served))
    woken: list[set[int]] = []  # what lost() said when the monitor woke its listener (a fan-out's wait)
    monitor.listen(lambda: woken.append(set(monitor.lost())))
    try:
        _until(lambda: all(h.last_beat > 0 for h in monitor.snapshot()))
        served.relay_servers[node_c.id].stop(0.0)
        _until(lambda: 4 in monitor.lost() and 5 in monitor.unwatched(), LOSS_BOUND_S)
        assert set(monitor.lost()) == {4} and set(monitor.unwatched()) == {5}
        assert woken == [{4}]  # woken once, after the loss is readable; an unwatched rank wakes no one
        assert "Relay.Watch" in monitor.lost()[4] and "rank 4's process on node-c" in monitor.lost()[4]
        assert monitor.unwatched()[5].startswith(RELAY_LOST)
        five = monitor.snapshot()[5]
        assert five.healthy and five.unwatched_reason is not None  # not counted lost: its process lives
        # The other relays' ranks still beat.
        before = {h.rank: h.last_beat for h in monitor.snapshot()}
        _until(lambda: all(monitor.snapshot()[r].last_beat > before[r] for r in (0, 1, 2, 3, 6, 7)))
    finally:
        monitor.close()


def test_a_reader_reports_each_rank_once_on_its_thread(served: ServedTree) -> None:
    reports: list[tuple[str, int]] = []
    threads: set[str] = set()

    def note(kind: str) -> Callable[[int, object], None]:
        def record(rank: int, _: object) -> None:
            threads.add(threading.current_thread().name)
            if kind != "beat":
                reports.append((kind, rank))
        return record

    reader = SubtreeReader(_node_relays(served), interval_s=INTERVAL_S, stall_s=STALL_S, on_beat=note("beat"),
                           on_lost=note("lost"), on_unwatched=note("unwatched"))
    try:
        served.relay_servers[served.tree.node_relay("node-a").id].stop(0.0)
        _until(lambda: len(reports) >= 2)
        served.servers[0].stop(0.0)  # rank 0's owner, already reported with its relay: not again
        served.servers[7].stop(0.0)
        _until(lambda: ("lost", 7) in reports)
    finally:
        reader.close()
    assert sorted(reports) == [("lost", 0), ("lost", 7), ("unwatched", 1)]
    assert threads == {"zero_ray-subtree-watch"}


def test_watch_refuses_a_stall_bound_under_its_interval(served: ServedTree) -> None:
    relay = served.relay_servers[served.tree.node_relay("node-b").id]
    stub = relay_pb2_grpc.RelayStub(raw_channel(relay.address))
    request = relay_pb2.WatchRequest(header=header(served.credentials), interval_ms=100, stall_ms=100)
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.Watch(request, metadata=bearer_metadata(served.credentials.token), timeout=WAIT_S)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stall_ms=100" in caught.value.details()
    with pytest.raises(ConfigError, match="below stall_s"):
        SubtreeHealthMonitor(_node_relays(served), interval_s=1.0, timeout_s=1.0)


def test_the_fast_beat_conversion_is_the_generic_one() -> None:
    # heartbeat_of names the fields itself (for speed): a field added to the message fails here.
    message = owner_pb2.Heartbeat(**{f.name: (1.5 if f.type == f.TYPE_DOUBLE else "s" if f.type == f.TYPE_STRING
                                              else 7 + i) for i, f in enumerate(owner_pb2.Heartbeat.DESCRIPTOR.fields)})
    assert heartbeat_of(message) == to_record(message, Heartbeat)
