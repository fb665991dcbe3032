"""Ray metrics record the steps on their own timer (issue 43: no step waits on Ray's metric
calls), and still record every step, in order, with what remains recorded at close."""

from __future__ import annotations

import threading
from typing import Any

from zero_ray.driver.metrics import RunMetrics
from zero_ray.driver.reports import StepMetrics


def _metrics(step: int, seconds: float) -> StepMetrics:
    return StepMetrics(step=step, loss=0.5 * step, grad_norm=1.0, lr=0.1, skipped=False, loss_scale=1.0, samples=8,
                       item_count=16.0, items_per_second=0.0, step_seconds=seconds, owner_compute_seconds=0.05,
                       data_wait_seconds=0.0, bytes_sent=64 * step, sent_ahead=False)


class _Recorded:
    """A Ray metric standing in: every call, in order, on one shared log."""

    def __init__(self, name: str, log: list[tuple[str, str, float]]) -> None:
        self._name, self._log = name, log

    def inc(self, value: float) -> None:
        self._log.append((self._name, "inc", value))

    def observe(self, value: float) -> None:
        self._log.append((self._name, "observe", value))

    def set(self, value: float, tags: Any = None) -> None:
        self._log.append((self._name, "set", value))


def test_every_step_is_recorded_in_order_and_close_records_what_remains() -> None:
    log: list[tuple[str, str, float]] = []
    run = RunMetrics("run-x", publish_s=3600.0)  # the timer never fires here: close() must record them
    for name in ("_steps", "_step_seconds", "_loss", "_samples_per_second", "_items_per_second", "_step_bytes_sent"):
        setattr(run, name, _Recorded(name, log))
    run.start()
    for step, seconds in ((1, 0.5), (2, 0.0), (3, 0.25)):
        run.completed.append(_metrics(step, seconds))
    run.close()
    assert not run.completed
    assert [v for n, k, v in log if n == "_steps"] == [1, 1, 1]
    assert [v for n, k, v in log if n == "_step_seconds"] == [0.5, 0.0, 0.25]
    # a zero-second step sets no rate, as before: the gauges end at the last step's
    assert [v for n, k, v in log if n == "_samples_per_second"] == [16.0, 32.0]
    assert [v for n, k, v in log if n == "_loss"][-1] == 1.5
    assert [v for n, k, v in log if n == "_step_bytes_sent"][-1] == 192.0


def test_the_timer_records_steps_while_the_run_goes_on() -> None:
    log: list[tuple[str, str, float]] = []
    seen = threading.Event()

    class _Steps(_Recorded):
        def inc(self, value: float) -> None:
            super().inc(value)
            seen.set()

    run = RunMetrics("run-y", publish_s=0.01)
    for name in ("_step_seconds", "_loss", "_samples_per_second", "_items_per_second", "_step_bytes_sent"):
        setattr(run, name, _Recorded(name, log))
    run._steps = _Steps("_steps", log)  # type: ignore[assignment]
    run.start()
    try:
        run.completed.append(_metrics(1, 0.5))
        assert seen.wait(30.0)  # recorded by the timer, with the run still open
        assert not run.completed
    finally:
        run.close()
    assert [n for n, k, v in log if n == "_steps"] == ["_steps"]
