"""FanOut without Ray: its thread pools grow with the pool, aborts never queue behind blocked
steps, a loss seen while waiting is raised at once and the survivors of the pool's Members
aborted meanwhile (the recovery's abort waits for that one), and failed
calls become domain errors from their fields."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from zero_ray.control.rank_watch import LossListeners
from zero_ray.driver import fanout
from zero_ray.driver.fanout import FanOut, Members, control_error
from zero_ray.errors import (
    CallTimeout,
    CheckpointError,
    ConfigError,
    ControlError,
    FailureDetail,
    OwnerError,
    OwnerLostError,
    RemoteFailure,
)

WAIT_S = 10.0  # every wait here is bounded by this
ENTER_S = WAIT_S / 4  # shorter than a blocked step's wait: a step that cannot start is seen as such


def _fan(world_size: int) -> FanOut:
    return FanOut(world_size=world_size, members=Members())


@pytest.mark.parametrize("grown_to", [2, 24])
def test_aborts_never_queue_behind_blocked_steps_after_the_pool_grew(grown_to: int) -> None:
    fan = _fan(2)
    fan.fit(grown_to)  # what OwnerPool does on every membership change
    assert fan.threads >= FanOut.threads_for(grown_to)
    clients: list[Any] = [object() for _ in range(grown_to)]
    entered = threading.Semaphore(0)
    release = threading.Event()

    def step(client: Any, rank: int) -> int:
        entered.release()
        if not release.wait(WAIT_S):
            raise TimeoutError("the test never released the steps")
        return rank

    results: list[list[int]] = []
    stepping = threading.Thread(target=lambda: results.append(fan.grpc(clients, "step", step)), daemon=True)
    stepping.start()
    try:
        for _ in range(grown_to):  # every owner's step holds a thread: none waits for another
            assert entered.acquire(timeout=ENTER_S), "a step never started: the pool is too small"
        aborted = fan.urgent(dict(enumerate(clients)), lambda client: True, timeout_s=WAIT_S)
        assert aborted == {r: True for r in range(grown_to)} and stepping.is_alive()
    finally:
        release.set()
        stepping.join(WAIT_S)
    assert results == [list(range(grown_to))]
    fan.close()


def test_the_pools_never_shrink_and_calls_in_flight_survive_a_resize() -> None:
    fan = _fan(8)
    size = fan.threads
    fan.fit(2)
    assert fan.threads == size
    started, release = threading.Event(), threading.Event()

    def slow(client: Any, rank: int) -> str:
        started.set()
        release.wait(WAIT_S)
        return "done"

    out: list[list[str]] = []
    call = threading.Thread(target=lambda: out.append(fan.grpc([object()], "save", slow)), daemon=True)
    call.start()
    assert started.wait(WAIT_S)
    fan.fit(64)  # replaces the pools while the call runs on the old one
    release.set()
    call.join(WAIT_S)
    assert out == [["done"]] and fan.threads == FanOut.threads_for(64)
    fan.close()


def test_the_first_failure_is_raised_as_the_owners_own_error_naming_its_rank() -> None:
    fan = _fan(3)
    detail = FailureDetail(type="CheckpointError", message="rank-00002 is missing", rank=0, phase="idle",
                           operation="PartitionOwner.Load")

    def load(client: Any, i: int) -> None:
        if i == 1:
            raise RemoteFailure("PartitionOwner.Load failed", code="FAILED_PRECONDITION", detail=detail)

    with pytest.raises(CheckpointError, match=r"^rank 7 failed in PartitionOwner.Load \(idle\): rank-00002") as info:
        fan.grpc([object()] * 3, "load", load, ranks=[5, 7, 9])
    assert info.value.failure is detail
    fan.close()


@pytest.mark.parametrize(("code", "expected"), [("UNAVAILABLE", OwnerLostError), ("DEADLINE_EXCEEDED", CallTimeout),
                                                ("CANCELLED", OwnerError)])
def test_transport_failures_name_the_owner(code: str, expected: type) -> None:
    err = control_error(ControlError("no", code=code), "rank 2 on node x", 2, "reshard")
    assert type(err) is expected and err.rank == 2 and str(err).startswith("rank 2 on node x failed in reshard")


@pytest.mark.parametrize("kind", [OwnerLostError, CallTimeout, OwnerError])
def test_a_relayed_transport_failure_is_rebuilt_as_the_driver_would_name_it(kind: type) -> None:
    # A relay names a child it could not reach (control/relay_hop._detail); the driver's recovery
    # tells a timeout (stall diagnosis) and a lost owner (a re-formed step retried) by the type.
    detail = FailureDetail(type=kind.__name__, message="PartitionOwner.Step to 10.0.0.5:7 did not answer", rank=3,
                           operation="PartitionOwner.Step", remote_traceback="tb")
    err = detail.error("rank 3 on node x", rank=3)
    assert type(err) is kind and err.rank == 3 and err.failure is detail and err.remote_traceback == "tb"
    assert str(err).startswith("rank 3 on node x failed in PartitionOwner.Step: PartitionOwner.Step to 10.0.0.5:7")


def test_ray_carries_only_the_bootstrap_and_the_data_path() -> None:
    fan = _fan(1)
    with pytest.raises(ConfigError, match="'reshard' is a control operation: call it over gRPC"):
        fan.ray([object()], "reshard", timeout_s=1.0)
    fan.close()


class _Health:
    """A health monitor that has lost the ranks it is given, and those it is told to lose later
    (``lose``: its listeners woken, as the real monitors' reader threads wake them)."""

    def __init__(self, lost: dict[int, str]) -> None:
        self._lost = dict(lost)
        self._listeners = LossListeners()

    def lost(self) -> dict[int, str]:
        return dict(self._lost)

    def lose(self, rank: int, reason: str) -> None:
        self._lost[rank] = reason
        self._listeners.ring()

    def listen(self, wake: Callable[[], None]) -> None:
        self._listeners.add(wake)

    def unlisten(self, wake: Callable[[], None]) -> None:
        self._listeners.discard(wake)


class _Client:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, int]] = []

    def abort(self, reason: str, generation: int, *, timeout_s: float) -> bool:
        self.aborts.append((reason, generation))
        return True


def test_a_loss_seen_while_waiting_aborts_the_survivors_of_the_members_generation_and_names_the_node() -> None:
    members = Members(generation=4)
    members.clients = [_Client() for _ in range(3)]
    members.nodes = [{"ip": f"10.0.0.{r}", "pid": 100 + r} for r in range(3)]
    fan = FanOut(world_size=3, members=members)
    release = threading.Event()

    def step(client: Any, rank: int) -> int:
        release.wait(WAIT_S)  # blocked as a step whose peer died is
        return rank

    members.watch(_Health({1: "stream closed"}))  # type: ignore[arg-type]
    try:
        with pytest.raises(OwnerLostError, match=r"rank 1 on node 10.0.0.1 \(pid 101\) stopped answering during "
                                                 r"step: stream closed") as info:
            fan.grpc(members.clients, "step", step)
    finally:
        release.set()
    assert info.value.rank == 1
    fan.abort("the recovery's abort")  # waits for the one the loss began, and sends nothing twice
    reasons = [c.aborts for c in members.clients]  # type: ignore[attr-defined]
    assert reasons[1] == [] and reasons[0] == reasons[2] == [(str(info.value), 4)]
    fan.close()


class _HeldAbort(_Client):
    """An owner whose abort takes as long as the test holds it (one slow call of thousands);
    ``arrives=False``: behind a cut link, the abort is never taken (not recorded)."""

    def __init__(self, release: threading.Event, *, arrives: bool = True) -> None:
        super().__init__()
        self.entered = threading.Event()
        self._release = release
        self._arrives = arrives

    def abort(self, reason: str, generation: int, *, timeout_s: float) -> bool:
        self.entered.set()
        self._release.wait(WAIT_S)
        return super().abort(reason, generation, timeout_s=timeout_s) if self._arrives else True


def test_the_loss_is_decided_before_the_survivors_abort_is_answered_and_the_recovery_abort_waits_for_it() -> None:
    # Before: check() sent Abort to every survivor and waited for all of them before raising
    # (3.2-4.9 s at 8,192 owners), so a relay's loss was decided late.
    import time

    release = threading.Event()
    members = Members(generation=7)
    held = _HeldAbort(release)
    members.clients = [_Client(), _Client(), held]  # type: ignore[list-item]
    members.watch(_Health({1: "relay stream closed"}))  # type: ignore[arg-type]
    fan = FanOut(world_size=3, members=members)
    try:
        t0 = time.monotonic()
        with pytest.raises(OwnerLostError) as info:
            fan.check("step")
        assert time.monotonic() - t0 < ENTER_S and not release.is_set()
        assert held.entered.wait(WAIT_S)  # the abort is out, and still unanswered
        with pytest.raises(OwnerLostError):
            fan.check("evaluate")  # a second look in the same generation sends no second abort
        recovery = threading.Thread(target=fan.abort, args=("recovery",), kwargs={"lost": [1]})
        recovery.start()
        recovery.join(ENTER_S / 5)
        assert recovery.is_alive()  # the recovery's abort returns only once every survivor took one
        release.set()
        recovery.join(WAIT_S)
        assert not recovery.is_alive()
    finally:
        release.set()
    taken = [c.aborts for c in members.clients]  # type: ignore[attr-defined]
    assert taken == [[(str(info.value), 7)], [], [(str(info.value), 7)]]
    fan.close()


class _SlowTree:
    """The relay tree's abort (``RelayPlane.abort``) on a starved machine: one subtree, rank 0,
    called unless ``gone()`` holds it (it took this generation's abort already); it returns after
    ``takes_s`` (its calls' deadline, past one call's time), rank 0 having taken it."""

    def __init__(self, takes_s: float) -> None:
        self.calls = 0
        self._takes_s = takes_s

    def abort(self, reason: str, generation: int, *, gone: Callable[[], Any], timeout_s: float) -> set[int]:
        if 0 in gone():
            return set()
        self.calls += 1
        threading.Event().wait(self._takes_s)  # how long the tree's calls take; nothing to wait for
        return {0}


def test_the_recovery_abort_joins_a_slow_first_abort_and_no_survivor_takes_two(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the recovery's abort gave up on the one check() began after one call's time plus the
    # direct calls' (here 2.5 s; 15 s on the pool), though that abort can take its tree's deadline
    # plus the direct calls' (here 1.2 + 2 s), and sent every survivor a second abort while the
    # first was still out: 2,488 aborts for 1,023 survivors at 1,024 owners under load 226.
    monkeypatch.setattr(fanout, "_ABORT_CALL_S", 0.5)
    monkeypatch.setattr(fanout, "_ABORT_WAIT_S", 2.0)
    old_join_s = 2.5
    members = Members(generation=6)
    release = threading.Event()
    held = _HeldAbort(release)  # rank 2: not under a live subtree, called directly
    members.clients = [_Client(), _Client(), held]  # type: ignore[list-item]
    members.watch(_Health({1: "relay stream closed"}))  # type: ignore[arg-type]
    tree = _SlowTree(takes_s=1.2)
    members.relays = tree  # type: ignore[assignment]
    fan = FanOut(world_size=3, members=members)
    try:
        t0 = time.monotonic()
        with pytest.raises(OwnerLostError) as info:
            fan.check("step")
        recovery = threading.Thread(target=fan.abort, args=("recovery",))
        recovery.start()
        assert held.entered.wait(WAIT_S)  # the direct call, after the tree's 1.2 s
        # Answered past the old join, inside the direct calls' own 2 s: the first abort reached it.
        release.wait(max(0.0, t0 + old_join_s + 0.3 - time.monotonic()))
        release.set()
        recovery.join(WAIT_S)
        assert not recovery.is_alive()
    finally:
        release.set()
    assert tree.calls == 1  # rank 0 took it through the tree once
    assert [c.aborts for c in members.clients] == [[], [], [(str(info.value), 6)]]  # type: ignore[attr-defined]
    fan.close()


def test_the_recovery_abort_resends_to_a_survivor_the_first_abort_missed_and_a_new_generation_anew() -> None:
    members = Members(generation=3)

    class _Refuses(_Client):
        def __init__(self) -> None:
            super().__init__()
            self.tries = 0

        def abort(self, reason: str, generation: int, *, timeout_s: float) -> bool:
            self.tries += 1
            if self.tries == 1:
                raise ControlError("busy", code="RESOURCE_EXHAUSTED")
            return super().abort(reason, generation, timeout_s=timeout_s)

    refuses = _Refuses()
    members.clients = [_Client(), refuses, _Client()]  # type: ignore[list-item]
    members.watch(_Health({2: "gone"}))  # type: ignore[arg-type]
    fan = FanOut(world_size=3, members=members)
    with pytest.raises(OwnerLostError) as info:
        fan.check("step")
    fan.abort("recovery")
    members.generation = 4  # re-formed: an abort of the new generation goes to everyone again
    members.watch(_Health({}))  # type: ignore[arg-type]
    fan.abort("later")
    assert [c.aborts for c in members.clients] == [  # type: ignore[attr-defined]
        [(str(info.value), 3), ("later", 4)], [("recovery", 3), ("later", 4)], [("later", 4)]]
    fan.close()


class _LosesWhenEntered:
    """The health monitor loses the unreachable rank once its abort is out, as a partition's
    second rank is lost a moment after the first."""

    def __init__(self, first: int, late: int, entered: threading.Event) -> None:
        self._first, self._late, self._entered = first, late, entered

    def lost(self) -> dict[int, str]:
        lost = {self._first: "stalled"}
        if self._entered.is_set():
            lost[self._late] = "stalled"
        return lost

    def listen(self, wake: Callable[[], None]) -> None:  # its losses are only ever polled
        pass

    def unlisten(self, wake: Callable[[], None]) -> None:
        pass


def test_an_abort_does_not_wait_for_a_rank_lost_while_it_is_out() -> None:
    import time

    release = threading.Event()
    members = Members(generation=2)
    far = _HeldAbort(release, arrives=False)
    members.clients = [_Client(), _Client(), _Client(), far]  # type: ignore[list-item]
    members.watch(_LosesWhenEntered(1, 3, far.entered))  # type: ignore[arg-type]
    fan = FanOut(world_size=4, members=members)
    try:
        t0 = time.monotonic()
        fan.abort("partition")
        took = time.monotonic() - t0
    finally:
        release.set()
    # Before: the abort waited for rank 3's call to time out (5 s over gRPC; here the test's bound).
    assert took < ENTER_S, took
    assert [c.aborts for c in members.clients[:3]] == [[("partition", 2)], [], [("partition", 2)]]  # type: ignore[attr-defined]
    fan.close()


def test_an_abort_skips_the_ranks_its_caller_knows_are_lost() -> None:
    # Ray may report a cut node's actors dead (its GCS declared the node dead) before their
    # heartbeats have stalled for health_timeout_s: the recovery names them.
    import time

    release = threading.Event()
    members = Members(generation=5)
    far = _HeldAbort(release, arrives=False)
    members.clients = [_Client(), far, _Client()]  # type: ignore[list-item]
    fan = FanOut(world_size=3, members=members)
    try:
        t0 = time.monotonic()
        fan.abort("node dead", lost=[1])
        took = time.monotonic() - t0
    finally:
        release.set()
    assert took < ENTER_S and not far.entered.is_set()
    assert [c.aborts for c in members.clients] == [[("node dead", 5)], [], [("node dead", 5)]]  # type: ignore[attr-defined]
    fan.close()


WOKEN_S = 1.0  # a woken wait's bound here: far below the POLL_S the tests below set, on a busy machine


def _lose_when_waiting(health: _Health, rank: int, lost_at: list[float]) -> threading.Thread:
    """Report ``rank`` lost a moment after the wait began, on a thread of its own (the
    monitor's reader), noting when."""

    def report() -> None:
        time.sleep(0.05)  # not a synchronisation: only so the loss comes while the wait blocks
        lost_at.append(time.monotonic())
        health.lose(rank, "relay stream closed")

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("path", ["collect", "grpc"])
def test_a_loss_wakes_the_wait_at_once_not_at_its_next_look(path: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait would look at the monitor only every POLL_S: set to 30 s, a loss that did not wake
    # it would be decided 30 s late (0.16 s of a relay loss's 0.19 s decision at POLL_S = 0.2).
    monkeypatch.setattr(fanout, "POLL_S", 30.0)
    members = Members(generation=3)
    members.clients = [_Client() for _ in range(2)]  # type: ignore[list-item]
    health = _Health({})
    members.watch(health)  # type: ignore[arg-type]
    fan = FanOut(world_size=2, members=members)
    release, lost_at = threading.Event(), []  # type: ignore[var-annotated]
    never: Future[int] = Future()  # a reply that never comes while the test runs

    def step(client: Any, rank: int) -> int:
        release.wait(WAIT_S)
        return rank

    try:
        reporter = _lose_when_waiting(health, 1, lost_at)
        with pytest.raises(OwnerLostError, match="rank 1 stopped answering during step: relay stream closed"):
            if path == "collect":
                flight = FanOut.start(members.clients, "step",  # type: ignore[arg-type]
                                      lambda c, i: never)  # type: ignore[arg-type,return-value]
                fan.collect(flight)
            else:
                fan.grpc(members.clients, "step", step)  # type: ignore[arg-type]
        decided = time.monotonic() - lost_at[0]
        reporter.join(WAIT_S)
    finally:
        release.set()
        never.cancel()
    assert decided < WOKEN_S, decided
    fan.abort("recovery")
    assert [c.aborts for c in members.clients] == [[(_reason(1), 3)], []]  # type: ignore[attr-defined]
    fan.close()


def _reason(rank: int) -> str:
    return f"partition owner rank {rank} stopped answering during step: relay stream closed"


def test_a_wait_stops_listening_when_it_returns_and_a_listener_failure_stops_nobody() -> None:
    listeners, woken = LossListeners(), []

    def fails() -> None:
        raise RuntimeError("a listener's bug")

    listeners.add(fails)
    listeners.add(lambda: woken.append("second"))
    listeners.ring()
    assert woken == ["second"]
    health = _Health({})
    members = Members()
    members.clients = [_Client()]  # type: ignore[list-item]
    members.watch(health)  # type: ignore[arg-type]
    fan = FanOut(world_size=1, members=members)
    assert fan.grpc(members.clients, "status", lambda c, i: i * 7 + 1) == [1]  # type: ignore[arg-type]
    done: Future[int] = Future()
    done.set_result(5)
    flight = FanOut.start(members.clients, "step", lambda c, i: done)  # type: ignore[arg-type,return-value]
    assert fan.collect(flight) == [5]
    assert members._waits == ()  # nothing left to wake: no wait holds on
    assert health._listeners._wakes == [members._ring]  # the members listen once, not once per wait
    fan.close()


class _CountedHealth(_Health):
    def __init__(self) -> None:
        super().__init__({})
        self.asked = 0

    def lost(self) -> dict[int, str]:
        self.asked += 1
        return super().lost()


def test_a_wait_asks_the_monitor_nothing_until_it_rings_and_a_new_monitor_starts_quiet() -> None:
    # Before: every wait listened, unlistened and asked lost() (driver/health.py and
    # control/rank_watch.py on every step's path); now a loss's ring is what makes a wait ask.
    health = _CountedHealth()
    members = Members(generation=2)
    members.clients = [_Client(), _Client()]  # type: ignore[list-item]
    members.watch(health)  # type: ignore[arg-type]
    asked_at_set = health.asked  # once: a loss before the members listened
    fan = FanOut(world_size=2, members=members)
    done: Future[int] = Future()
    done.set_result(3)
    for _ in range(3):
        flight = FanOut.start(members.clients, "step", lambda c, i: done)  # type: ignore[arg-type,return-value]
        assert fan.collect(flight) == [3, 3]
        fan.check("step")
    assert health.asked == asked_at_set == 1
    health.lose(1, "stream closed")
    with pytest.raises(OwnerLostError, match="rank 1 stopped answering during step: stream closed"):
        fan.check("step")
    fan.abort("recovery")
    members.watch(_Health({}))  # type: ignore[arg-type]  # the next membership's monitor
    fan.check("step")  # the old monitor's loss is not the new one's
    assert health._listeners._wakes == []  # the old monitor no longer wakes anyone here
    fan.close()


def test_a_fan_out_returns_when_its_last_reply_arrives_not_at_the_next_poll() -> None:
    """grpc() waited with FIRST_EXCEPTION on the calls plus the loss-wake future, which never
    completes without a loss, so every fan-out took a whole POLL_S (0.2 s) however fast the owners
    answered: every checkpoint's Save(SNAPSHOT) on the step path, SetPeers, Stats, Setup
    (issue 46's soak: a checkpoint step 200-215 ms over the others). Timed against POLL_S itself:
    ten calls that answer at once take under one poll in all, where they took ten."""
    fan = _fan(4)
    clients: list[Any] = [object() for _ in range(4)]
    t = time.monotonic()
    for _ in range(10):
        assert fan.grpc(clients, "stats", lambda client, rank: rank) == [0, 1, 2, 3]
    assert time.monotonic() - t < fanout.POLL_S
    fan.close()

