"""What the control plane's asyncio loops share (control/heartbeats.py's reader, a relay hop's
child calls in control/hop_calls.py): a ``grpc.aio`` channel opened with a client's settings,
the loop's thread body (run, then the bounded wait for gRPC's own tasks before the loop closes),
and the stop asked of it from another thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import grpc

from zero_ray.control.client_channel import ClientConfig, channel_settings

log = logging.getLogger(__name__)

# How long closing waits for gRPC's own tasks of cancelled calls. They end within milliseconds, even
# with the server hung mid-beat (7 ms measured): the cancellation completes on this side.
DRAIN_S = 5.0


def open_channel(config: ClientConfig) -> grpc.aio.Channel:
    """An asyncio channel to ``config.address`` with the TLS and options of a blocking client's
    (call it on the loop that will use it)."""
    credentials, options = channel_settings(config)
    if credentials is None:
        return grpc.aio.insecure_channel(config.address, options=options)
    return grpc.aio.secure_channel(config.address, credentials, options=options)


async def drain(loop_name: str) -> None:
    """Wait (bounded) for every other task on this loop: grpc.aio ends a cancelled call in a task
    of its own (``_handle_status_once_received``) that waits for gRPC core's last event for it.
    Closed before that event arrives, the loop is gone when gRPC's poller hands the event to it,
    and whichever other loop of the process polls next prints ``RuntimeError: Event loop is
    closed`` (another trainer's heartbeat loop, in a notebook that trains twice)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if not others:
        return
    _, pending = await asyncio.wait(others, timeout=DRAIN_S)
    if pending:  # a call gRPC never finished: closing anyway beats hanging the caller's shutdown
        log.warning("closing the %s loop with %d gRPC task(s) still pending after %gs: %s", loop_name, len(pending),
                    DRAIN_S, ", ".join(sorted(t.get_name() for t in pending)))


def run_then_close(loop: asyncio.AbstractEventLoop, main: Coroutine[Any, Any, Any], loop_name: str) -> None:
    """A loop thread's body: run ``main`` on ``loop`` here, then close the loop once nothing can
    still be handed to it (gRPC's tasks drained, async generators and the default executor shut)."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(drain(loop_name))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def stop_from_outside(loop: asyncio.AbstractEventLoop, stop: asyncio.Event | None) -> None:
    """Set ``stop`` (the event ``main`` waits on) from another thread; nothing when the loop has
    not made it yet or has closed."""
    if stop is None or loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(stop.set)
    except RuntimeError:  # the loop closed meanwhile
        pass
