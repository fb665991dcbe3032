"""The thread-rank harness's bound (tests/thread_ranks.py): ranks still running when it passes
raise TimeoutError naming them, never a half-done result the caller reads as the run's (a
compiled TP run past the bound on a loaded machine failed as an IndexError in run_tp_ranks)."""

from __future__ import annotations

import threading

import pytest

from thread_ranks import ThreadGroup, on_threads


def test_ranks_past_the_bound_raise_timeout_not_a_partial_result() -> None:
    release = threading.Event()

    def rank_main(group: ThreadGroup) -> int:
        if group.rank == 1:
            release.wait(timeout=30)  # bounded: released below once the harness has given up
        return group.rank

    try:
        with pytest.raises(TimeoutError, match=r"thread ranks \[1\] of 2 still running after 0.2s"):
            on_threads(2, rank_main, timeout_s=0.2)
    finally:
        release.set()


def test_ranks_within_the_bound_return_every_result() -> None:
    assert on_threads(3, lambda group: group.rank * 10, timeout_s=30) == [0, 10, 20]
