"""The run's state machine (pure): causes carried, the transition table enforced, listeners told."""

from __future__ import annotations

import pytest

from zero_ray.driver.lifecycle import TRANSITIONS, InvalidTransition, Lifecycle, RunState, TrainerState
from zero_ray.errors import StopRequested, ZeroRayError

S = TrainerState


def test_states_carry_their_cause_and_listeners_see_every_move() -> None:
    life = Lifecycle()
    seen: list[tuple[RunState, RunState]] = []
    life.subscribe(lambda old, new: seen.append((old, new)))
    with life.during(S.STEPPING, cause="step 3") as entered:
        assert life.current is entered and str(entered) == "stepping (step 3)"
    err = RuntimeError("rank 1 lost")
    life.move(S.RECOVERING, cause="step 4 failed", error=err)
    life.move(S.READY, cause="restored from peer")
    assert [(o.type, n.type) for o, n in seen] == [(S.READY, S.STEPPING), (S.STEPPING, S.READY),
                                                   (S.READY, S.RECOVERING), (S.RECOVERING, S.READY)]
    assert seen[2][1].error is err and [s.cause for s in life.history][-1] == "restored from peer"


def test_a_listener_subscribed_twice_is_told_once_and_an_unsubscribed_one_no_more() -> None:
    life = Lifecycle()
    seen: list[str] = []

    def listener(old: RunState, new: RunState) -> None:
        seen.append(new.cause)

    life.subscribe(listener)
    life.subscribe(listener)
    life.move(S.STEPPING, cause="step 1")
    life.unsubscribe(listener)
    life.unsubscribe(listener)  # a second time changes nothing
    life.move(S.READY, cause="done")
    assert seen == ["step 1"]


def test_the_table_is_enforced() -> None:
    life = Lifecycle()
    life.move(S.FAILED, cause="unrecoverable")
    with pytest.raises(InvalidTransition, match="from failed .* to ready"):
        life.move(S.READY)
    with pytest.raises(ZeroRayError, match="the trainer is failed"):
        life.require_ready()
    life.move(S.SHUT_DOWN)
    with pytest.raises(InvalidTransition):
        life.move(S.STEPPING)
    assert all(S.SHUT_DOWN in allowed for state, allowed in TRANSITIONS.items() if state is not S.SHUT_DOWN)
    assert not TRANSITIONS[S.SHUT_DOWN] and TRANSITIONS[S.FAILED] == {S.SHUT_DOWN}


def test_a_stop_lands_after_the_step_in_flight() -> None:
    life = Lifecycle()
    with life.during(S.STEPPING, cause="step 7"):
        assert life.request_stop("operator") == "stepping"  # the step finishes first
    assert life.state is S.STOPPING and life.current.cause == "operator"
    with pytest.raises(StopRequested, match="operator"):
        life.require_ready()
    assert Lifecycle().request_stop("now") == "stopping"  # between steps: at once


def test_the_history_keeps_the_latest_states_only() -> None:
    from zero_ray.driver.lifecycle import HISTORY_KEPT

    life = Lifecycle()
    for step in range(HISTORY_KEPT):  # two states a step, as every step of a run adds
        life.move(TrainerState.STEPPING, cause=f"step {step}")
        life.move(TrainerState.READY, cause=f"step {step} done")
    assert len(life.history) == HISTORY_KEPT
    assert life.history[-1].cause == f"step {HISTORY_KEPT - 1} done"
