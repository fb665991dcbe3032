"""Callbacks: what a run tells whoever watches it, as Ray Train's controller callbacks do.

The controller calls every registered callback after each state change, each completed step,
each committed checkpoint and each event (a membership change, a recovery, a resize). The run's
own observers are callbacks too: the operators' Metrics stream (the Coordinator) and the event
log ``zero-ray status`` shows; a user passes more with ``ZeroTrainer(callbacks=[...])``. (Ray
metrics, ``driver/metrics.RunMetrics``, record the steps on a timer of their own instead.) A
callback that raises is logged and the run goes on: observing training never stops it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from zero_ray.core.reply_combine import CombinedStep
from zero_ray.driver.lifecycle import Lifecycle, RunState
from zero_ray.driver.reports import StepMetrics
from zero_ray.errors import ConfigError

log = logging.getLogger(__name__)


class Callback:
    """Override what you need; every method does nothing by default."""

    def on_state(self, old: RunState, new: RunState) -> None:
        """The run moved from ``old`` to ``new`` (``new.cause`` says why)."""

    def on_step(self, metrics: StepMetrics, reply: CombinedStep) -> None:
        """A step completed: ``trainer.step()``'s metrics (read as a mapping too) and every
        owner's reply combined (``zr.CombinedStep``: the ranks it covers, exact loss totals,
        bytes sent per collective kind, non-finite ranks). Per-rank figures are
        ``trainer.comm_report()`` and ``memory_report()``: at scale a step's reply is combined
        on its way up the relay tree, so no one holds every rank's reply."""

    def on_checkpoint(self, path: str, step: int) -> None:
        """A checkpoint of step ``step`` was committed at ``path``."""

    def on_event(self, text: str) -> None:
        """Something operators should know happened (a resize, a recovery, an attach)."""


class EventLog(Callback):
    """The last ``keep`` events, oldest first (what ``zero-ray status`` lists)."""

    def __init__(self, keep: int = 200) -> None:
        self.keep = keep
        self.events: list[str] = []

    def on_event(self, text: str) -> None:
        self.events.append(text)
        del self.events[:-self.keep]


class Callbacks:
    """The registered callbacks, called in order; each event only to those that override its
    method (the base methods do nothing, and a step would otherwise call every one of them).
    While none overrides ``on_state`` (``on_step``) the lifecycle (the stepper) does not call
    here at all: a step's two moves and its completion cost a default run nothing."""

    _METHODS = ("on_state", "on_step", "on_checkpoint", "on_event")

    def __init__(self, callbacks: Sequence[Callback] = (), *, states: Lifecycle | None = None) -> None:
        self._states = states  # the run's lifecycle: on_state is subscribed to it while a callback watches moves
        self._lock = threading.Lock()  # add / remove may come from a gRPC thread (a Metrics stream)
        self._callbacks: list[Callback] = list(callbacks)
        # method -> the callbacks overriding it; a new tuple on every change, so a caller
        # iterating the old one on another thread is never disturbed
        self._by_method: dict[str, tuple[Callback, ...]] = {}
        self.steps_watched = False  # some callback overrides on_step: the stepper skips on_step otherwise
        self._changed()

    def _index(self) -> dict[str, tuple[Callback, ...]]:
        return {m: tuple(cb for cb in self._callbacks
                         if getattr(getattr(cb, m), "__func__", None) is not getattr(Callback, m))
                for m in self._METHODS}

    def _changed(self) -> None:
        self._by_method = self._index()
        self.steps_watched = bool(self._by_method["on_step"])
        if self._states is not None:  # no watcher (the default run): a step's two moves call nothing here
            (self._states.subscribe if self._by_method["on_state"] else self._states.unsubscribe)(self.on_state)

    def add(self, callback: Callback) -> None:
        with self._lock:
            self._callbacks.append(callback)
            self._changed()

    def remove(self, callback: Callback) -> None:
        """Stop telling ``callback`` (a no-op when it is not registered)."""
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
                self._changed()

    def _each(self, method: str, *args: Any) -> None:
        for cb in self._by_method[method]:
            try:
                getattr(cb, method)(*args)
            except Exception:  # an observer's failure never fails the run
                log.warning("callback %s.%s failed", type(cb).__name__, method, exc_info=True)

    def on_state(self, old: RunState, new: RunState) -> None:
        self._each("on_state", old, new)

    def on_step(self, metrics: StepMetrics, reply: CombinedStep) -> None:
        self._each("on_step", metrics, reply)

    def on_checkpoint(self, path: str, step: int) -> None:
        self._each("on_checkpoint", path, step)

    def on_event(self, text: str) -> None:
        log.info(text)
        self._each("on_event", text)


def check_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """``ZeroTrainer(callbacks=...)`` as a list, or a ConfigError naming what is not a Callback."""
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    try:
        given = list(callbacks)
    except TypeError as err:
        raise ConfigError(f"callbacks={callbacks!r} must be a list of zr.Callback instances") from err
    for cb in given:
        if not isinstance(cb, Callback):
            raise ConfigError(f"callbacks: {cb!r} is not a zr.Callback; subclass zr.Callback and override "
                              "on_step / on_state / on_checkpoint / on_event")
    return given
