"""RecoveryController.grow_now when room comes back after a loss (the lost owners' slots freed
late: a node cut off, issue 46's long link cut): with continue_on_survivors it starts replacements
and goes on, taking them at the first boundary at which they answer, instead of returning a size
whose grow starts the owners itself and stalls every step for their start (9-11 s measured in the
soak). Pure: a stand-in pool, no Ray."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from zero_ray.core.elastic_policy import FailurePolicy, ScalingPolicy
from zero_ray.driver.recovery import RecoveryController


class _Replacements:
    def __init__(self) -> None:
        self.started: Any = None
        self.up = False

    def ready(self) -> bool:
        return self.started is not None and self.up

    def expired(self, timeout_s: float) -> bool:
        return False

    def discard(self) -> None:
        self.started = None

    @property
    def slots(self) -> int:
        return 0


class _Pool:
    def __init__(self) -> None:
        self.world_size, self.tensor_parallel, self.room = 2, 1, 0
        self.spec = SimpleNamespace(init_timeout_s=60.0)
        self.replacements = _Replacements()
        self.starts: list[int] = []

    def free_slots(self) -> int:
        return self.room

    def start_replacements(self, world_size: int) -> None:
        self.starts.append(world_size)
        self.replacements.started = SimpleNamespace(world_size=world_size)


def _controller(pool: _Pool, *, continue_on_survivors: bool) -> RecoveryController:
    return RecoveryController(pool, failure=FailurePolicy(), desired=4, peer_redundancy=True,  # type: ignore[arg-type]
                              scaling=ScalingPolicy(continue_on_survivors=continue_on_survivors),
                              checkpoint_root=lambda: None, grow_check_s=0.0)


def test_room_that_comes_back_starts_replacements_and_the_steps_go_on() -> None:
    pool = _Pool()
    rc = _controller(pool, continue_on_survivors=True)
    assert rc.grow_now() is None and pool.starts == []  # no room yet: the cut-off node holds it
    pool.room = 2
    assert rc.grow_now() is None and pool.starts == [4]  # started, not grown to: no step waits
    assert rc.grow_now() is None and pool.starts == [4]  # still starting: neither waited for nor started again
    pool.replacements.up = True
    assert rc.grow_now() == 4  # up: this boundary's grow takes them in


def test_without_continue_on_survivors_the_grow_is_at_once() -> None:
    pool = _Pool()
    pool.room = 2
    assert _controller(pool, continue_on_survivors=False).grow_now() == 4 and pool.starts == []
