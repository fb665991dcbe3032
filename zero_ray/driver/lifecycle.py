"""The run's lifecycle: a small state machine the trainer moves, read by operators' threads.

    READY --step--> STEPPING --done--> READY
    READY --resize--> RESIZING --done--> READY
    any live state --failure--> RECOVERING --recovered--> READY | --gave up--> FAILED
    READY/STEPPING --stop request--> STOPPING (step() refuses new steps)
    any --shutdown--> SHUT_DOWN
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from zero_ray.errors import StopRequested, ZeroRayError


class TrainerState(enum.Enum):
    """The run's lifecycle, as the controller moves it."""

    READY = "ready"
    STEPPING = "stepping"
    RECOVERING = "recovering"  # aborting collectives and re-forming or rebuilding after a failure
    RESIZING = "resizing"  # moving partitions to a new number of owners
    STOPPING = "stopping"  # an operator asked the run to stop; step() refuses new steps
    FAILED = "failed"  # the owners' state can no longer be trusted
    SHUT_DOWN = "shut_down"


_FINAL = (TrainerState.FAILED, TrainerState.SHUT_DOWN)


class Lifecycle:
    """The current state and the reason a stop was asked for, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = TrainerState.READY
        self.stop_reason: str | None = None

    @property
    def state(self) -> TrainerState:
        return self._state

    def require_ready(self) -> None:
        """Raise unless a new step or operation may start."""
        state = self._state
        if state is TrainerState.STOPPING:
            raise StopRequested(f"the run was asked to stop: {self.stop_reason}")
        if state is not TrainerState.READY:
            raise ZeroRayError(f"the trainer is {state.value}; create a new ZeroTrainer")

    def require_alive(self) -> None:
        if self._state in _FINAL:
            raise ZeroRayError(f"the trainer is {self._state.value}")

    def move(self, to: TrainerState) -> None:
        """Enter ``to`` (a final state is left only for SHUT_DOWN; a stop request is kept over
        READY)."""
        with self._lock:
            if self._state in _FINAL and not (self._state is TrainerState.FAILED and to is TrainerState.SHUT_DOWN):
                return
            if to is TrainerState.READY and self.stop_reason is not None:
                to = TrainerState.STOPPING
            self._state = to

    @contextmanager
    def during(self, state: TrainerState) -> Iterator[None]:
        """In ``state`` for the block; READY again after it unless something moved the state on
        (a failure, a stop request)."""
        self.move(state)
        try:
            yield
        finally:
            with self._lock:
                if self._state is state:
                    self._state = TrainerState.STOPPING if self.stop_reason is not None else TrainerState.READY

    def request_stop(self, reason: str) -> str:
        """Ask the run to stop after the step in flight; returns the state afterwards."""
        with self._lock:
            self.stop_reason = reason or "stop requested"
            if self._state in (TrainerState.READY, TrainerState.STEPPING):
                self._state = TrainerState.STOPPING
            return self._state.value
