"""The run's lifecycle: typed states that carry their cause, a transition table the controller
may not leave, and callbacks told of every move. Read by operators' threads (status, stop).

    READY --step--> STEPPING --done--> READY
    READY --resize--> RESIZING --done--> READY
    READY/STEPPING/RESIZING --failure--> RECOVERING --recovered--> READY | --gave up--> FAILED
    READY/STEPPING --stop request--> STOPPING (step() refuses new steps)
    any --shutdown--> SHUT_DOWN

A move the table does not allow is a bug in the controller and raises ``InvalidTransition``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zero_ray.errors import StopRequested, ZeroRayError

if TYPE_CHECKING:
    from zero_ray.driver.recovery import RecoveryReport


class TrainerState(enum.Enum):
    """What the controller is doing (a state's type; ``RunState`` adds its cause)."""

    READY = "ready"
    STEPPING = "stepping"
    RECOVERING = "recovering"  # aborting collectives and re-forming or rebuilding after a failure
    RESIZING = "resizing"  # moving partitions to a new number of owners
    STOPPING = "stopping"  # an operator asked the run to stop; step() refuses new steps
    FAILED = "failed"  # the owners' state can no longer be trusted
    SHUT_DOWN = "shut_down"


_S = TrainerState
HISTORY_KEPT = 1024  # states kept in Lifecycle.history
FINAL = frozenset({_S.FAILED, _S.SHUT_DOWN})
#: from -> the states it may move to
TRANSITIONS: dict[TrainerState, frozenset[TrainerState]] = {
    _S.READY: frozenset({_S.STEPPING, _S.RESIZING, _S.RECOVERING, _S.STOPPING, _S.FAILED, _S.SHUT_DOWN}),
    _S.STEPPING: frozenset({_S.READY, _S.RECOVERING, _S.STOPPING, _S.FAILED, _S.SHUT_DOWN}),
    _S.RESIZING: frozenset({_S.READY, _S.RECOVERING, _S.STOPPING, _S.FAILED, _S.SHUT_DOWN}),
    _S.RECOVERING: frozenset({_S.READY, _S.STOPPING, _S.FAILED, _S.SHUT_DOWN}),
    # a run asked to stop still finishes the step in flight, recovers from its failure, saves
    _S.STOPPING: frozenset({_S.STEPPING, _S.RECOVERING, _S.FAILED, _S.SHUT_DOWN}),
    _S.FAILED: frozenset({_S.SHUT_DOWN}),
    _S.SHUT_DOWN: frozenset(),
}


class InvalidTransition(ZeroRayError):
    """The controller tried a move its transition table does not allow (a bug)."""


@dataclass(frozen=True, kw_only=True)
class RunState:
    """A state and why it was entered: the step being taken, the sizes of a resize, the error
    being recovered from or that failed the run, the reason for a stop. Typed payloads, as Ray
    Train's states carry theirs: ``error`` (RECOVERING, FAILED), ``world_size`` (RESIZING: the
    target; READY or FAILED after a recovery: the size it left) and ``recovery`` (READY or FAILED
    after a recovery: what the policies decided and what was done)."""

    type: TrainerState
    cause: str = ""
    error: BaseException | None = field(default=None, compare=False)
    world_size: int | None = None
    recovery: RecoveryReport | None = field(default=None, compare=False)
    since: float = field(default_factory=time.monotonic, compare=False)

    @property
    def value(self) -> str:
        return self.type.value

    def __str__(self) -> str:
        return self.type.value + (f" ({self.cause})" if self.cause else "")


Listener = Callable[[RunState, RunState], None]


class Lifecycle:
    """The current state and the reason a stop was asked for, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = RunState(type=_S.READY, cause="started")
        self.stop_reason: str | None = None
        # The latest states entered, oldest first: bounded, since every step adds two (STEPPING,
        # READY) and a long run would otherwise grow it without end.
        self.history: deque[RunState] = deque([self._state], maxlen=HISTORY_KEPT)
        self._listeners: tuple[Listener, ...] = ()  # replaced, never changed: move() reads it unlocked

    @property
    def state(self) -> TrainerState:
        return self._state.type

    @property
    def current(self) -> RunState:
        return self._state

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(old, new)`` after every move (on the mover's thread, outside the lock);
        once, however often it is subscribed."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (nothing when it is not subscribed)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def require_ready(self) -> None:
        """Raise unless a new step or operation may start."""
        state = self._state.type
        if state is _S.STOPPING:
            raise StopRequested(f"the run was asked to stop: {self.stop_reason}")
        if state is not _S.READY:
            raise ZeroRayError(f"the trainer is {self._state}; create a new ZeroTrainer")

    def require_alive(self) -> None:
        if self._state.type in FINAL:
            raise ZeroRayError(f"the trainer is {self._state}")

    def move(self, to: TrainerState, *, cause: str = "", error: BaseException | None = None,
             world_size: int | None = None, recovery: RecoveryReport | None = None) -> RunState:
        """Enter ``to`` (READY becomes STOPPING while a stop is asked for); raises
        ``InvalidTransition`` for a move the table does not allow."""
        with self._lock:
            old = self._state
            if to is _S.READY and self.stop_reason is not None:
                to, cause = _S.STOPPING, self.stop_reason
            if to is not old.type and to not in TRANSITIONS[old.type]:
                raise InvalidTransition(f"the controller may not move from {old} to {to.value} ({cause})")
            self._state = new = RunState(type=to, cause=cause, error=error, world_size=world_size, recovery=recovery)
            self.history.append(new)
        for listener in self._listeners:
            listener(old, new)
        return new

    @contextmanager
    def during(self, state: TrainerState, *, cause: str = "", world_size: int | None = None) -> Iterator[RunState]:
        """In ``state`` for the block; READY again after it unless something moved the state on
        (a failure, a stop request)."""
        entered = self.move(state, cause=cause, world_size=world_size)
        try:
            yield entered
        finally:
            if self._state is entered:
                self.move(_S.READY, cause=f"{state.value} done")

    def request_stop(self, reason: str) -> str:
        """Ask the run to stop after the step in flight; returns the state afterwards."""
        with self._lock:
            self.stop_reason = reason or "stop requested"
            stop = self._state.type is _S.READY
        if stop:
            self.move(_S.STOPPING, cause=self.stop_reason)
        return self._state.value
