"""Ending an actor in a test and knowing it is gone."""

from __future__ import annotations

import time
from typing import Any

import ray


def kill_and_wait(actor: Any, *, timeout_s: float = 30.0) -> None:
    """``ray.kill(actor)`` and return once Ray refuses calls to it. The kill is asynchronous: a
    call submitted right after it may still run, so calls are repeated (each bounded) until one
    fails with RayActorError."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.node.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
    raise AssertionError(f"actor {actor} still answers {timeout_s:g}s after ray.kill")
