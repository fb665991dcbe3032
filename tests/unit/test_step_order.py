"""Steps sent ahead (fit's pipelining) on an owner: run after the step before, never after a
failed one, and let go by an abort; which steps fit sends ahead."""

from __future__ import annotations

import threading

import pytest

from zero_ray.driver.fit import FitPlan
from zero_ray.errors import CollectiveError
from zero_ray.owner.service.step_order import StepOrder


def _waiter(order: StepOrder, *, generation: int, step: int) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def wait() -> None:
        try:
            order.wait_for_previous(rank=1, generation=generation, step=step, timeout_s=30.0)
            out.append("run")
        except CollectiveError as err:
            out.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def test_a_step_sent_ahead_waits_for_the_one_before_and_runs_once_it_completed() -> None:
    order = StepOrder()
    order.ended(generation=2, step=3, completed=True)
    thread, out = _waiter(order, generation=2, step=5)  # arrived before step 5 (index 4) ran
    thread.join(0.3)
    assert thread.is_alive() and out == []  # still waiting: step index 4 has not ended here
    order.ended(generation=2, step=4, completed=True)
    thread.join(10)
    assert out == ["run"]


def test_a_step_sent_ahead_is_not_run_after_a_failed_step_or_an_abort() -> None:
    order = StepOrder()
    thread, out = _waiter(order, generation=1, step=7)
    order.ended(generation=1, step=6, completed=False)
    thread.join(10)
    assert isinstance(out[0], CollectiveError) and "step 7 did not complete here" in str(out[0])
    thread, out = _waiter(order, generation=1, step=8)
    order.interrupt(1)
    thread.join(10)
    assert isinstance(out[0], CollectiveError) and "generation 1 was aborted" in str(out[0])
    # A later generation's step is not refused for an older generation's abort.
    order.ended(generation=3, step=0, completed=True)
    order.wait_for_previous(rank=0, generation=3, step=1, timeout_s=1.0)


def test_a_step_sent_ahead_gives_up_after_its_timeout_and_after_a_newer_generation_ended_a_step() -> None:
    order = StepOrder()
    with pytest.raises(CollectiveError, match=r"step 3 was sent ahead, but step 2 did not end here within 0.1s"):
        order.wait_for_previous(rank=0, generation=0, step=2, timeout_s=0.1)
    order.ended(generation=5, step=9, completed=True)  # a reform happened: generation 4's step is stale
    with pytest.raises(CollectiveError, match="did not complete here"):
        order.wait_for_previous(rank=0, generation=4, step=10, timeout_s=1.0)


def test_fit_sends_ahead_only_steps_with_no_evaluation_or_checkpoint_before_them() -> None:
    plan = FitPlan(global_batch_size=4, steps=10, eval_every=4, checkpoint_every=3)
    assert [i for i in range(12) if plan.pipelines(i)] == [1, 2, 5, 7]
    assert [i for i in range(6) if FitPlan(global_batch_size=4, steps=5).pipelines(i)] == [0, 1, 2, 3, 4]
