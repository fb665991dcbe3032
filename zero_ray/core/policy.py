"""Failure policy: what to do after a step failed. Inputs in, a decision out (pure).

The driver's controller carries the decision out; nothing here touches actors.
"""

from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass


class Action(enum.Enum):
    REFORM = "reform"  # abort the survivors' collectives, re-form the group, continue
    FAIL = "fail"  # stop: the run cannot continue consistently


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Without a way to restore a lost partition (checkpoints, redundancy), a lost rank ends the
    run; a step that failed on live ranks before any weight changed can be retried after the
    group is re-formed. ``max_failures`` bounds how often that may happen in one run."""

    max_failures: int = 3

    def after_step_failure(self, *, lost_ranks: Set[int], failures_so_far: int) -> Decision:
        if lost_ranks:
            return Decision(action=Action.FAIL, reason=f"ranks {sorted(lost_ranks)} were lost and their partitions "
                                                       "cannot be restored without a checkpoint")
        if failures_so_far >= self.max_failures:
            return Decision(action=Action.FAIL, reason=f"{failures_so_far} step failures reached {self.max_failures=}")
        return Decision(action=Action.REFORM, reason="all ranks alive: abort, re-form the group and continue")

    def after_reform(self, *, consistent: bool) -> Decision:
        if consistent:
            return Decision(action=Action.REFORM, reason="no rank had started its update: the state is intact")
        return Decision(action=Action.FAIL, reason="a rank had started updating weights: the partitions may disagree")
