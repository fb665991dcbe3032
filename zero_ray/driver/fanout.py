"""FanOut: one call on every owner at once, over the gRPC control plane (or, for the data path
and the bootstrap only, through Ray).

Every wait is bounded. While waiting, the health monitor is watched: when it reports an owner
lost (it wakes the wait: the pool's ``Members`` listen to each monitor once, from ``Members.watch``,
so a wait with no loss asks the monitor nothing), ``OwnerLostError`` is raised at once and
the survivors' collectives of the current generation are aborted meanwhile on a thread of its
own (so that none of them waits out ``collective_timeout_s`` on the dead one, whatever the
operation: a step, a resize transfer, a rebuild, a peer snapshot). The decision does not wait
for that abort (one call per survivor: seconds at 8,192 owners); the recovery's ``abort`` joins
it, completes it, and returns only once every survivor that answers has taken it, before
anything re-forms. The first failure of any owner is raised at once too: the others may be
blocked on the failed one. A step's staging calls (the Ray calls handing each owner its piece)
are watched as well: one that fails fails the step at once with its own error, instead of the
owner waiting for a piece that never comes.

Remote failures come back as domain errors: a handler's from the FailureDetail its status
carried (its own type when zero_ray.errors has it, else OwnerError; rank, phase and remote
traceback included), a Ray task error as the cause's own type, an unreachable owner or a dead
actor as OwnerLostError naming its rank and node. No text is parsed.

FanOut reads the pool's membership from the ``Members`` the pool owns and hands it (the
clients, where each owner is, the health monitor, the generation): it calls nothing back in
the pool. Aborting the survivors is itself a call on every owner, so it is FanOut's.

Threads: gRPC calls run on two pools sized from the pool's world size and grown with it
(:meth:`FanOut.fit`, called on every membership change): long calls (a step holds a thread per
owner for its deadline; a checkpoint's commit thread may wait on every owner meanwhile) on one,
aborts, stats and liveness probes on the other, so they never queue behind blocked steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import ray

from zero_ray.control.client_channel import Pending
from zero_ray.control.client import OwnerClient
from zero_ray.control.rank_watch import RankHealthWatch
from zero_ray.errors import (
    CallTimeout,
    ConfigError,
    ControlError,
    OwnerError,
    OwnerLostError,
    RemoteFailure,
    ZeroRayError,
    domain_error,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often a wait looks at the health monitor and the staging calls when nothing wakes it: a
# loss wakes collect and grpc at once (Members.waiting), so this bounds only the staging calls'
# failures and Ray's waits.
POLL_S = 0.2
_WOKEN = -1  # put in a flight's arrivals by the health monitor's loss: look at it now
_ABORT_CALL_S = 5.0  # one owner's Abort call
_ABORT_WAIT_S = 10.0  # the survivors' aborts, all of them


def _abort_join_s() -> float:
    """How long the recovery's abort waits for the one ``check`` began before sending its own.
    That abort ends by its own deadlines: the tree's calls (a call's time and the relays'
    margins, under two calls' time) then the direct ones (``_ABORT_WAIT_S``). A starved machine
    stretches both, and a resend while it is still out reaches every survivor twice (2,488
    aborts for 1,023 survivors at load 226, where the join gave up after 15 s of a 27 s abort),
    so the join allows it four times its nominal time before taking it as stuck."""
    return 4 * (2 * _ABORT_CALL_S + _ABORT_WAIT_S)

# The only actor methods the driver calls on an owner through Ray (tests/unit/test_control_rule.py
# checks the sources): the bootstrap before gRPC can be spoken, and the data path, which carries
# Python objects and object references. Every other operation is a gRPC method.
RAY_METHODS = frozenset({"node", "credentials", "run_spec", "stage_batch", "register_dataset", "use_filesystem",
                         "master_fragments"})
# Transport failures meaning the owner is gone or stuck, not that it refused.
_LOST_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


def remote_error(err: Exception, where: str, rank: int, method: str) -> ZeroRayError:
    """A Ray failure of ``method`` on the owner ``where`` describes, as a domain error."""
    if isinstance(err, ray.exceptions.RayActorError):
        return OwnerLostError(f"partition owner {where} died during {method}: {err}", rank=rank)
    if isinstance(err, ray.exceptions.RayTaskError):
        cause, tb = err.cause, str(err)
    elif isinstance(err, ray.exceptions.RaySystemError):  # e.g. an argument that cannot be unpickled there
        cause, tb = err.client_exc, err.traceback_str or ""
    else:
        return OwnerError(f"{where} failed in {method}: {err!r}", rank=rank)
    while isinstance(cause, ray.exceptions.RaySystemError) and cause.client_exc is not None:  # Ray nests them
        cause, tb = cause.client_exc, tb or cause.traceback_str or ""
    text = f"{where} failed in {method}: {cause}"
    # The user's own exception types keep their name in the text (as a control call's failure does).
    return domain_error(type(cause), f"{text}\n\nRemote traceback:\n{tb}" if tb else text, rank=rank,
                        fallback=f"{where} failed in {method}: {type(cause).__name__}: {cause}", remote_traceback=tb)


def control_error(err: ControlError, where: str, rank: int, what: str) -> ZeroRayError:
    """A failed control call as a domain error: the handler's own error rebuilt from its
    FailureDetail, else (a transport failure) OwnerLostError when the owner is unreachable or
    did not answer in time, OwnerError otherwise."""
    if isinstance(err, RemoteFailure):
        return err.detail.error(where, rank=rank)
    cls = (CallTimeout if err.code == "DEADLINE_EXCEEDED" else OwnerLostError if err.code in _LOST_CODES
           else OwnerError)
    return cls(f"{where} failed in {what}: {err}", rank=rank)


@dataclass(kw_only=True)
class InFlight(Generic[T]):
    """Calls begun on every owner and not yet collected (``FanOut.start``)."""

    what: str
    staged: dict[int, Any]
    calls: list[Pending[T]] = field(default_factory=list)
    arrived: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue)
    deadline: float | None = None  # time.monotonic(); besides each call's own gRPC deadline
    timeout_s: float = 0.0

    def expire_in(self, timeout_s: float) -> None:
        """Fail the calls not answered ``timeout_s`` from now (a step sent ahead: from when the
        step before it ended), as their gRPC deadline would."""
        self.deadline, self.timeout_s = time.monotonic() + timeout_s, timeout_s

    def cancel(self) -> None:
        """Stop waiting for the replies (the owners are told the calls were cancelled)."""
        for call in self.calls:
            call.cancel()


@dataclass(frozen=True, kw_only=True)
class StepFlight:
    """A step sent to every owner (``OwnerPool.start_step``): directly, or down the relay tree."""

    calls: InFlight[Any]
    relayed: bool

    def expire_in(self, timeout_s: float) -> None:
        """See ``InFlight.expire_in``."""
        self.calls.expire_in(timeout_s)

    def cancel(self) -> None:
        self.calls.cancel()


@dataclass(kw_only=True)
class _Aborting:
    """A generation's abort begun by ``FanOut.check``: the ranks known lost meanwhile (not
    waited for), those that took it, and whether it is done."""

    generation: int
    known: tuple[int, ...] = ()  # replaced, never changed in place: the abort's thread reads it
    answered: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)


class SubtreeAbort(Protocol):
    """The survivors' abort through the relay tree (``RelayPlane``): one call per live subtree,
    around the relays that ran in a lost rank's process; the ranks that took it."""

    def abort(self, reason: str, generation: int, *, gone: Callable[[], Collection[int]],
              timeout_s: float) -> set[int]: ...


class Members:
    """The owners of a pool as a fan-out reaches them, in rank order: each one's control client
    and node record (``node`` at start-up: ip, pid, name, node id, control address), the health
    monitor over them (None before the first owner is connected) and the collective group's
    generation. ``OwnerPool`` owns the one instance and changes it on every membership change;
    its ``FanOut`` reads it, so a fan-out sees the membership of the moment it looks."""

    def __init__(self, *, generation: int = 0) -> None:
        self.clients: list[OwnerClient] = []
        self.nodes: list[dict[str, Any]] = []
        self.relays: SubtreeAbort | None = None  # while steps take the relay tree
        self.generation = generation
        # The monitor is listened to once, from ``watch``: a loss sets ``losing`` and wakes the
        # waits in ``_waits``, so that a wait neither registers with the monitor nor asks it
        # anything while no rank is lost (every step waits; losses are rare).
        self._health: RankHealthWatch | None = None
        self.losing = False  # the current monitor has lost a rank: FanOut.check asks it which
        self._waits_lock = threading.Lock()
        self._waits: tuple[Callable[[], None], ...] = ()

    @property
    def health(self) -> RankHealthWatch | None:
        """The health monitor now (set by ``watch``)."""
        return self._health

    def watch(self, monitor: RankHealthWatch | None) -> None:
        """Listen to ``monitor`` (None: to none) instead of the one before, which is no longer
        listened to (closing it stays its owner's); ``losing`` says whether it has lost a rank."""
        old, self._health = self._health, monitor
        if old is not None:
            old.unlisten(self._ring)
        self.losing = False
        if monitor is not None:
            monitor.listen(self._ring)
            if monitor.lost():  # lost before it was listened to: no ring will say so
                self.losing = True

    def _ring(self) -> None:
        """The monitor lost a rank (on its reader thread): every wait looks now."""
        self.losing = True
        for wake in self._waits:
            wake()

    @contextmanager
    def waiting(self, wake: Callable[[], None]) -> Iterator[None]:
        """``wake`` called the moment the monitor loses a rank, while the block runs."""
        with self._waits_lock:
            self._waits = (*self._waits, wake)
        try:
            yield
        finally:
            with self._waits_lock:
                self._waits = tuple(w for w in self._waits if w is not wake)

    def lost(self) -> dict[int, str]:
        """The ranks the health monitor has lost, with why."""
        return self._health.lost() if self._health is not None else {}

    def where(self, rank: int) -> str:
        """``rank`` and where it runs, for messages."""
        node = self.nodes[rank] if rank < len(self.nodes) else {}
        return f"rank {rank}" + (f" on node {node.get('ip')} (pid {node.get('pid')})" if node else "")


class FanOut:
    """Bounded calls on every owner of a pool; ``members``: the pool's membership, read at each
    look (the clients of a call are passed with the call: some reach only some owners)."""

    def __init__(self, *, world_size: int, members: Members) -> None:
        self._members = members
        self._where = members.where
        self._lock = threading.Lock()
        self._size = 0
        self._aborting: _Aborting | None = None  # the last abort check() began
        self._closed = False
        self._calls = self._urgent = ThreadPoolExecutor(max_workers=1)  # replaced by fit()
        self.fit(world_size)

    # -- threads -----------------------------------------------------------------------------------------
    @staticmethod
    def threads_for(world_size: int) -> int:
        """Threads per pool for ``world_size`` owners: two fan-outs at once (a step and a
        checkpoint's commit; an abort and a status query) plus a few single calls."""
        return 2 * world_size + 4

    @property
    def threads(self) -> int:
        """The threads each pool may use now."""
        return self._size

    def fit(self, world_size: int) -> None:
        """Grow both thread pools for ``world_size`` owners (never shrink: idle threads cost
        nothing). Calls in flight finish on the pools they started on."""
        need = self.threads_for(world_size)
        with self._lock:
            if need <= self._size:
                return
            old = (self._calls, self._urgent)
            self._calls = ThreadPoolExecutor(max_workers=need, thread_name_prefix="zero_ray-rpc")
            self._urgent = ThreadPoolExecutor(max_workers=need, thread_name_prefix="zero_ray-urgent")
            self._size = need
        for executor in old:
            executor.shutdown(wait=False)

    def _submit(self, urgent: bool, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:  # never onto a pool fit() has just shut down
            return (self._urgent if urgent else self._calls).submit(fn, *args)

    # -- waiting -----------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        """Raise ``OwnerLostError`` when the health monitor has lost an owner, the survivors'
        abort sent meanwhile (:meth:`abort_soon`): the decision does not wait for one call per
        survivor (seconds at 8,192 owners); :meth:`abort` joins it before anything re-forms."""
        if not self._members.losing:  # the monitor has lost no rank: nothing to ask it
            return
        lost = self._members.lost()
        if lost:
            rank = min(lost)
            reason = f"partition owner {self._where(rank)} stopped answering during {what}: {lost[rank]}"
            self.abort_soon(reason)
            raise OwnerLostError(reason, rank=rank)

    def abort_soon(self, reason: str) -> None:
        """Begin aborting the current generation's collectives on every survivor, on a thread of
        its own, and return at once; a generation's abort is sent once (a second loss seen
        before it is out joins it). :meth:`abort` waits for it and completes it."""
        generation = self._members.generation
        with self._lock:
            if self._aborting is not None and self._aborting.generation == generation:
                return
            aborting = _Aborting(generation=generation)
            self._aborting = aborting
        thread = threading.Thread(target=self._abort_in_background, args=(aborting, reason),
                                  name="zero_ray-abort-survivors", daemon=True)
        thread.start()

    def _abort_in_background(self, aborting: _Aborting, reason: str) -> None:
        try:
            aborting.answered.update(self._abort_all(reason, aborting.generation, lambda: aborting.known))
        except BaseException as err:  # never raises: the recovery's abort sends to every survivor again
            (log.debug if self._closed else log.warning)("aborting the survivors failed: %r", err)
        finally:
            aborting.done.set()

    def abort(self, reason: str, *, lost: Collection[int] = ()) -> None:
        """Abort the current generation's collectives on every owner that still answers (neither
        in ``lost``, the ranks the caller knows are gone, nor lost by the health monitor), on the
        pool no step occupies; when it returns, every survivor that answers has taken it (an
        abort begun by :meth:`check` is waited for, and not sent again to those that took it).
        Never raises."""
        generation = self._members.generation
        with self._lock:
            aborting = self._aborting
        answered: set[int] = set()
        if aborting is not None and aborting.generation == generation:
            aborting.known = (*aborting.known, *lost)  # not waited for there either
            if aborting.done.wait(_abort_join_s()):
                answered = set(aborting.answered)
        skip = {*lost, *answered}
        self._abort_all(reason, generation, lambda: skip)

    def _abort_all(self, reason: str, generation: int, skip: Callable[[], Collection[int]]) -> set[int]:
        """Abort ``generation`` on every owner neither in ``skip()`` (looked at again while the
        calls are out) nor lost by the health monitor; the ranks that took it."""
        members = self._members

        def gone() -> set[int]:
            return {*members.lost(), *skip()}

        answered: set[int] = set()
        tree = members.relays
        # The live subtrees first: a call each, not one per survivor. A rank that took an earlier
        # abort of this generation counts as gone there too, so no subtree holding one is called again.
        if tree is not None:
            try:
                answered = tree.abort(reason, generation, gone=gone, timeout_s=_ABORT_CALL_S)
            except Exception as err:  # the direct calls below reach every survivor instead
                log.warning("aborting the survivors through the relay tree failed: %r", err)
        skipped = gone() | answered
        # A rank lost while the abort is out is not waited for: behind a cut link the abort
        # cannot arrive, and waiting out its timeout delayed every partition's recovery by 5 s.
        got = self.urgent({r: c for r, c in enumerate(members.clients) if r not in skipped},
                          lambda c: c.abort(reason, generation, timeout_s=_ABORT_CALL_S), timeout_s=_ABORT_WAIT_S,
                          skip=gone)
        for rank, result in got.items():
            if isinstance(result, Exception):  # an owner that cannot take the abort is found lost next
                log.debug("abort did not reach rank %d: %s", rank, result)
            else:
                answered.add(rank)
        return answered

    def _check_staged(self, staged: dict[int, Any]) -> None:
        """Raise the error of a staging call that failed; forget those that succeeded."""
        if not staged:
            return
        ready, _ = ray.wait(list(staged.values()), num_returns=len(staged), timeout=0)
        index = {ref: rank for rank, ref in staged.items()}
        for ref in ready:
            rank = index[ref]
            del staged[rank]
            try:
                ray.get(ref)
            except Exception as err:  # the piece never reaches the owner: the step fails now
                raise remote_error(err, self._where(rank), rank, "stage_batch") from err

    # -- calls -------------------------------------------------------------------------------------------
    def ray(self, actors: Sequence[Any], method: str, *args: Any, timeout_s: float,
            per_rank: Sequence[tuple[Any, ...]] | None = None, kwargs: Sequence[dict[str, Any]] | None = None,
            watch: bool = True, ranks: Sequence[int] | None = None) -> list[Any]:
        """``actors[i].method(...)`` for every i through Ray, for the methods of
        ``RAY_METHODS`` only; results in order. ``ranks`` names the actors in errors (default:
        their positions)."""
        if method not in RAY_METHODS:
            raise ConfigError(f"{method!r} is a control operation: call it over gRPC (Ray carries only "
                              f"{sorted(RAY_METHODS)})")
        names = list(ranks) if ranks is not None else list(range(len(actors)))
        refs = [getattr(a, method).remote(*(per_rank[i] if per_rank else args), **(kwargs[i] if kwargs else {}))
                for i, a in enumerate(actors)]
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(names[index[r]] for r in pending)
                raise OwnerLostError(f"ranks {late} did not finish {method} within {timeout_s:g}s", rank=late[0])
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, POLL_S))
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except Exception as err:
                    raise remote_error(err, self._where(names[i]), names[i], method) from err
            if watch:
                self.check(method)
        return [results[i] for i in range(len(refs))]

    def grpc(self, clients: Sequence[OwnerClient], what: str, call: Callable[[OwnerClient, int], T], *,
             watch: bool = True, staged: Mapping[int, Any] | None = None,
             ranks: Sequence[int] | None = None) -> list[T]:
        """``call(client, i)`` for every ``clients[i]`` over the control plane; results in order.
        ``ranks`` names the owners in errors (default: their positions); ``staged``: the staging
        calls (Ray object references, by position) that the calls' pieces depend on."""
        names = list(ranks) if ranks is not None else list(range(len(clients)))
        futures = {self._submit(False, call, c, i): i for i, c in enumerate(clients)}
        staging = dict(staged or {})
        results: dict[int, T] = {}
        pending = set(futures)
        woken: Future[None] = Future()  # failed on a loss, so that the wait returns

        def wake() -> None:  # only ever on the monitor's one reader thread
            if not woken.done():
                woken.set_exception(InterruptedError("the health monitor lost a rank"))

        with self._members.waiting(wake):
            while pending:
                # Once woken, no longer waited on: a loss check() does not raise for (watch=False)
                # would otherwise make every wait return at once.
                waiting = pending if woken.done() else {*pending, woken}
                # FIRST_COMPLETED, not FIRST_EXCEPTION: ``woken`` never completes without a loss, so
                # "all completed" never came and every fan-out took a whole POLL_S (issue 46's soak).
                done, pending = wait(waiting, timeout=POLL_S, return_when=FIRST_COMPLETED)
                pending.discard(woken)
                for fut in done - {woken}:
                    i = futures[fut]
                    try:
                        results[i] = fut.result()
                    except ControlError as err:
                        raise control_error(err, self._where(names[i]), names[i], what) from err
                self._check_staged(staging)
                if watch:
                    self.check(what)
        return [results[i] for i in range(len(clients))]

    @staticmethod
    def start(clients: Sequence[OwnerClient], what: str, start: Callable[[OwnerClient, int], Pending[T]], *,
              staged: Mapping[int, Any] | None = None) -> InFlight[T]:
        """For calls in gRPC's future form (``start`` begins one and returns at once): begin
        ``start(client, i)`` on every owner and return at once. ``collect`` waits, with no pool
        thread per owner, each reply handled as it arrives. The per-step path."""
        flight: InFlight[T] = InFlight(what=what, staged=dict(staged or {}))
        for i, client in enumerate(clients):
            call = start(client, i)
            call.add_done_callback(lambda _, i=i: flight.arrived.put(i))
            flight.calls.append(call)
        return flight

    def collect(self, flight: InFlight[T]) -> list[T]:
        """Every reply of ``flight`` in order; the health monitor looked at the moment it loses a
        rank (it wakes the wait), and with the staging calls every ``POLL_S``."""
        what, calls, staging = flight.what, flight.calls, flight.staged
        results: dict[int, T] = {}
        checked = time.monotonic()
        with self._members.waiting(lambda: flight.arrived.put(_WOKEN)):
            while len(results) < len(calls):
                try:
                    i = flight.arrived.get(timeout=POLL_S)
                except queue.Empty:
                    i = None
                if i is not None and i != _WOKEN:
                    try:
                        results[i] = calls[i].result()
                    except ControlError as err:
                        raise control_error(err, self._where(i), i, what) from err
                # Not once per reply (O(owners) each): on a loss, a silence, or every POLL_S.
                if i is None or i == _WOKEN or time.monotonic() - checked >= POLL_S:
                    checked = time.monotonic()
                    self._check_staged(staging)
                    self.check(what)
                    if flight.deadline is not None and checked > flight.deadline and len(results) < len(calls):
                        late = min(set(range(len(calls))) - set(results))
                        raise CallTimeout(f"{self._where(late)} did not finish {what} within "
                                          f"{flight.timeout_s:g}s", rank=late)
        return [results[i] for i in range(len(calls))]

    def urgent(self, targets: Mapping[int, OwnerClient], call: Callable[[OwnerClient], T], *,
               timeout_s: float, skip: Callable[[], Collection[int]] | None = None) -> dict[int, T | Exception]:
        """``call(client)`` on each target (by rank) at once, on the pool that no step occupies;
        each result, or the exception it raised (TimeoutError past ``timeout_s``; OwnerLostError
        for a rank in ``skip()``, looked at every ``POLL_S``, which is no longer waited for).
        Never raises."""
        futures = {rank: self._submit(True, call, client) for rank, client in targets.items()}
        deadline = time.monotonic() + timeout_s
        pending = dict(futures)
        while pending and time.monotonic() < deadline:
            wait(pending.values(), timeout=min(POLL_S, max(0.0, deadline - time.monotonic())),
                 return_when=FIRST_COMPLETED)
            gone = set(skip()) if skip is not None else set()
            pending = {r: f for r, f in pending.items() if not f.done() and r not in gone}
        out: dict[int, T | Exception] = {}
        for rank, fut in futures.items():
            if not fut.done():
                out[rank] = (TimeoutError(f"no answer within {timeout_s:g}s") if rank in pending else
                             OwnerLostError(f"rank {rank} was lost before it answered", rank=rank))
                continue
            try:
                out[rank] = fut.result()
            except Exception as err:  # reported to the caller, who decides
                out[rank] = err
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executors = (self._calls, self._urgent)
        for executor in executors:
            executor.shutdown(wait=False, cancel_futures=True)
