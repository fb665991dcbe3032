"""Callbacks tell each event only to the callbacks that override its method, and the Coordinator
is told of steps only while a Metrics stream is open (issue 43: a step calls no observer that
has nothing to do)."""

from __future__ import annotations

import threading
from typing import Any

from zero_ray.driver.callbacks import Callback, Callbacks
from zero_ray.driver.coordinator import Coordinator
from zero_ray.driver.lifecycle import RunState, TrainerState
from zero_ray.driver.reports import StepMetrics


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=0.5 * step, grad_norm=1.0, lr=0.1, skipped=False, loss_scale=1.0, samples=8,
                       item_count=8.0, items_per_second=80.0, step_seconds=0.1, owner_compute_seconds=0.05,
                       data_wait_seconds=0.0, bytes_sent=64, sent_ahead=False)


class _States(Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_state(self, old: RunState, new: RunState) -> None:
        self.seen.append(f"{old.type.value}->{new.type.value}")


class _Steps(Callback):
    def __init__(self, fail: bool = False) -> None:
        self.steps: list[int] = []
        self.fail = fail

    def on_step(self, metrics: StepMetrics, reply: Any) -> None:
        self.steps.append(metrics.step)
        if self.fail:
            raise RuntimeError("an observer's bug")


def test_each_event_reaches_the_callbacks_overriding_it_in_order_and_a_failure_stops_none() -> None:
    states, failing, steps = _States(), _Steps(fail=True), _Steps()
    callbacks = Callbacks([states, failing])
    callbacks.add(steps)
    ready, stepping = RunState(type=TrainerState.READY), RunState(type=TrainerState.STEPPING)
    callbacks.on_state(ready, stepping)
    callbacks.on_step(_metrics(1), None)  # type: ignore[arg-type]
    assert states.seen == ["ready->stepping"]
    assert failing.steps == [1] and steps.steps == [1]
    callbacks.remove(failing)
    callbacks.remove(failing)  # a second remove changes nothing
    callbacks.on_step(_metrics(2), None)  # type: ignore[arg-type]
    assert failing.steps == [1] and steps.steps == [1, 2]


def test_a_method_set_on_the_instance_counts_as_overriding() -> None:
    told: list[str] = []
    cb = Callback()
    cb.on_event = told.append  # type: ignore[method-assign]
    Callbacks([cb]).on_event("resized 2 -> 4")
    assert told == ["resized 2 -> 4"]


def test_the_coordinator_hears_steps_only_while_a_metrics_stream_is_open() -> None:
    callbacks = Callbacks()
    coordinator = Coordinator(status=lambda flight: None, stop=lambda reason: "stopping",  # type: ignore[arg-type,return-value]
                              checkpoint=lambda path: ("", 0), resize=lambda n: None,  # type: ignore[arg-type,return-value]
                              watchers=callbacks)
    callbacks.on_step(_metrics(1), None)  # type: ignore[arg-type]  # no stream: not told
    cancelled = threading.Event()
    stream = coordinator.metrics(cancelled)
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(next(stream).step), daemon=True)
    reader.start()
    # the generator joins the callbacks on its first next(); step until the reader has one event
    for step in range(2, 200):
        callbacks.on_step(_metrics(step), None)  # type: ignore[arg-type]
        reader.join(timeout=0.05)
        if got:
            break
    assert got and got[0] >= 2  # step 1 came before any stream was open
    stream.close()  # the last stream ends: not told any more
    coordinator.publish = lambda event: got.append(-1)  # type: ignore[method-assign]
    callbacks.on_step(_metrics(300), None)  # type: ignore[arg-type]
    assert -1 not in got


def test_steps_are_watched_only_while_a_callback_overrides_on_step() -> None:
    # the stepper reads this and calls on_step only when it is set (the default run watches none)
    callbacks = Callbacks([_States()])
    assert callbacks.steps_watched is False
    steps = _Steps()
    callbacks.add(steps)
    assert callbacks.steps_watched is True
    callbacks.remove(steps)
    assert callbacks.steps_watched is False


def test_the_lifecycle_tells_the_callbacks_of_moves_only_while_one_watches_them() -> None:
    # Before: every move (two a step) called Callbacks.on_state, which told no one in a default run.
    from zero_ray.driver.lifecycle import Lifecycle

    life = Lifecycle()
    callbacks = Callbacks([_Steps()], states=life)
    assert life._listeners == ()
    states = _States()
    callbacks.add(states)
    callbacks.add(_Steps())  # a change that leaves the watchers of moves as they are
    with life.during(TrainerState.STEPPING, cause="step 1"):
        pass
    assert states.seen == ["ready->stepping", "stepping->ready"]
    callbacks.remove(states)
    assert life._listeners == ()
    with life.during(TrainerState.STEPPING, cause="step 2"):
        pass
    assert states.seen == ["ready->stepping", "stepping->ready"]
