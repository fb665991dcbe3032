"""StepOrder: an owner runs steps sent ahead in order, and never after a failed one.

``fit`` pipelines its steps: the driver sends step k + 1 while step k runs (``StepArgs.ahead``),
so that the command is there when the owner finishes step k and the driver's own work for a
step (building requests, reading replies) overlaps the owners' compute. gRPC may deliver the two
requests in either order, and step k may fail here (a collective aborted, the loss function
raised, a non-finite step refused). A step sent ahead therefore waits until this owner has ended
step k in the same generation, and runs only if step k completed. Every rank refuses it alike
when step k failed anywhere: a rank whose own step k completed still needs the others in step
k + 1's collectives, and blocks there until the driver's recovery aborts it.

An abort (``interrupt``) or a new generation ends every wait at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from zero_ray.errors import CollectiveError


@dataclass(frozen=True, kw_only=True)
class Ended:
    """The last step this owner ended: its generation, index, and whether it completed."""

    generation: int
    step: int
    completed: bool


class StepOrder:
    """Where this owner's steps stand, for the requests sent ahead to wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ended: Ended | None = None
        self._interrupted = -1  # the latest generation an abort named

    def ended(self, *, generation: int, step: int, completed: bool) -> None:
        """Step ``step`` of ``generation`` is over here (``completed``: it counts)."""
        with self._cond:
            self._ended = Ended(generation=generation, step=step, completed=completed)
            self._cond.notify_all()

    def interrupt(self, generation: int) -> None:
        """An abort for ``generation``: a step of it (or before) sent ahead is not run."""
        with self._cond:
            self._interrupted = max(self._interrupted, generation)
            self._cond.notify_all()

    def wait_for_previous(self, *, rank: int, generation: int, step: int, timeout_s: float) -> None:
        """Return once step ``step - 1`` of ``generation`` completed here; raise
        ``CollectiveError`` when it failed, an abort came, or ``timeout_s`` passed."""
        previous = step - 1

        def settled() -> bool:
            e = self._ended
            return (self._interrupted >= generation
                    or (e is not None and (e.generation, e.step) >= (generation, previous)))

        with self._cond:
            if not self._cond.wait_for(settled, timeout=timeout_s):
                raise CollectiveError(f"rank {rank}: step {step + 1} was sent ahead, but step {previous + 1} did "
                                      f"not end here within {timeout_s:g}s")
            e = self._ended
            if self._interrupted >= generation:
                raise CollectiveError(f"rank {rank}: step {step + 1} was sent ahead and not run: generation "
                                      f"{generation} was aborted")
            assert e is not None
            if (e.generation, e.step) != (generation, previous) or not e.completed:
                raise CollectiveError(f"rank {rank}: step {step + 1} was sent ahead and not run: step "
                                      f"{previous + 1} did not complete here")
