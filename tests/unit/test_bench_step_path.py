"""The step-path census: the second difference keeps what grows with the steps and drops each
fit call's setup; the profile hook counts zero_ray calls on threads started after it."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from benchmarks import step_path
from benchmarks.harness import call_census


def test_per_step_keeps_step_work_and_cancels_setup() -> None:
    # 'setup' costs 10 per fit call; 'step' 3 per step; fits run to 2, 4 and 8 steps.
    before = Counter({"setup": 10, "step": 6})
    middle = Counter({"setup": 20, "step": 12})
    after = Counter({"setup": 30, "step": 24})
    assert step_path._per_step(before, middle, after, steps=2) == {"step": 3.0}


def test_census_counts_zero_ray_calls_on_new_threads(tmp_path: Path) -> None:
    from zero_ray.core.stages import stage_plan
    call_census.install(str(tmp_path))
    try:
        worker = threading.Thread(target=lambda: [stage_plan(2) for _ in range(5)])
        worker.start()
        worker.join(timeout=30)
    finally:
        call_census.uninstall()
    counts = call_census.read(str(tmp_path))[os.getpid()]
    stages = [n for n in counts if n.endswith("core/stages.py")]
    assert stages and counts[stages[0]] >= 5
