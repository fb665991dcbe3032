"""Server streams read on one asyncio loop in one thread: every owner's heartbeats
(:class:`HeartbeatReader`), and any other stream of beats (:class:`StreamReader`: the relays'
``Watch`` streams, control/subtree_watch.py).

A blocking stream needs a thread to wait in it: with a thread per owner the driver spent 1.33 s
of CPU per step at 1,024 owners on those threads alone (``benchmarks.control_scale``), each one
waking once per beat and contending for the GIL with the step. Here each stream is a task on one
loop (``grpc.aio``), and one task checks every stream's stall bound per tick.

A stream is lost when it ends with an error (the owner died: its sockets closed), when the
server ends it, or when no message arrives for ``stall_s`` (a frozen process keeps its sockets).

Closing cancels the streams, closes the channels, then waits for gRPC's own tasks of the
cancelled calls before the loop closes: a process may run many readers one after another (a
trainer's, then a resize's or the next trainer's), and gRPC hands a late event for a closed loop
to whichever loop polls next, which prints ``RuntimeError: Event loop is closed``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from zero_ray.control._generated import owner_pb2, owner_pb2_grpc
from zero_ray.control.aio_loop import open_channel, run_then_close, stop_from_outside
from zero_ray.control.auth import bearer_metadata
from zero_ray.control.client_channel import ClientConfig, check_timeout, convert_error, header_of
from zero_ray.control.handlers import Heartbeat
from zero_ray.errors import ConfigError

__all__ = ["HeartbeatReader", "OnBeat", "OnLost", "OnMessage", "StreamReader", "StreamTarget", "health_target", "heartbeat_of"]

OnBeat = Callable[[int, Heartbeat], None]
OnLost = Callable[[int, str], None]
OnMessage = Callable[[int, Any], None]
# The server-streaming method a stream is read from, on a channel to its server (a generated
# stub's, e.g. ``lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Health``).
StreamRpcOf = Callable[[grpc.aio.Channel], Any]


@dataclass(frozen=True, kw_only=True)
class StreamTarget:
    """One stream a :class:`StreamReader` reads: where and how (its client's configuration),
    which method (``operation`` names it in a loss's reason) and the request that opens it."""

    config: ClientConfig
    operation: str
    rpc: StreamRpcOf
    request: Any

    def __post_init__(self) -> None:
        if not callable(self.rpc) or not self.operation:
            raise ConfigError(f"StreamTarget(address={self.config.address!r}) needs its operation's name and a "
                              "channel's server-streaming method")


def health_target(config: ClientConfig, interval_s: float) -> StreamTarget:
    """An owner's ``PartitionOwner.Health`` stream, a beat every ``interval_s``."""
    request = owner_pb2.HealthRequest(header=header_of(config), interval_ms=max(1, round(interval_s * 1000)))
    return StreamTarget(config=config, operation="PartitionOwner.Health", request=request,
                        rpc=lambda channel: owner_pb2_grpc.PartitionOwnerStub(channel).Health)


def heartbeat_of(message: owner_pb2.Heartbeat) -> Heartbeat:
    """A beat's record, built field by field: conversion.to_record's by-name walk costs 7.7 us a
    beat against 2.1 us here, on the driver's thread, for every rank every interval
    (``python -m benchmarks.relay_health``)."""
    return Heartbeat(rank=message.rank, step=message.step, state=message.state, timestamp=message.timestamp,
                     rss_bytes=message.rss_bytes)


class StreamReader:
    """Reads every target's stream and calls ``on_message(i, message)`` for each message of
    target ``i`` and ``on_lost(i, reason)`` once when its stream is lost (both on the reader's
    thread: keep them short). ``close()`` ends every stream without reporting losses."""

    _targets: tuple[StreamTarget, ...]
    _stall_s: float
    _on_message: OnMessage
    _on_lost: OnLost
    _last: list[float]
    _stalled: list[bool]
    _tasks: list[asyncio.Task[None]]
    _closing: bool
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event | None
    _ready: threading.Event
    _thread: threading.Thread

    def __init__(self, targets: Sequence[StreamTarget], *, stall_s: float, on_message: OnMessage, on_lost: OnLost,
                 name: str = "heartbeats") -> None:
        check_timeout("stall_s", stall_s)
        self._targets = tuple(targets)
        self._stall_s = stall_s
        self._on_message, self._on_lost = on_message, on_lost
        n = len(self._targets)
        self._last = [time.monotonic()] * n  # when each stream last delivered (or opened)
        self._stalled = [False] * n
        self._tasks = []
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._stop = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(name,), daemon=True, name=f"zero_ray-{name}")
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self, name: str) -> None:
        run_then_close(self._loop, self._main(), name)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        channels = [open_channel(t.config) for t in self._targets]
        self._tasks = [asyncio.create_task(self._watch(i, ch)) for i, ch in enumerate(channels)]
        watchdog = asyncio.create_task(self._stalls())
        self._ready.set()
        await self._stop.wait()
        self._closing = True
        for task in (*self._tasks, watchdog):
            task.cancel()
        await asyncio.gather(*self._tasks, watchdog, return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

    async def _watch(self, index: int, channel: grpc.aio.Channel) -> None:
        target = self._targets[index]
        where = f"{target.operation} to {target.config.address}"
        call = target.rpc(channel)(target.request, metadata=bearer_metadata(target.config.credentials.token))
        self._last[index] = time.monotonic()
        try:
            async for message in call:
                self._last[index] = time.monotonic()
                self._on_message(index, message)
            reason = f"{where} ended: the server stopped streaming (shutting down?)"
        except asyncio.CancelledError:
            call.cancel()
            if not self._stalled[index] or self._closing:
                raise
            reason = f"{where} sent nothing for {self._stall_s:g}s (stall_s); the stream was cancelled"
        except grpc.aio.AioRpcError as err:
            reason = str(convert_error(where, err, None))
        if not self._closing:
            self._on_lost(index, reason)

    async def _stalls(self) -> None:
        # The poll is what a stall's detection may lag by: stall_s / 20, between 10 and 250 ms.
        poll = min(max(self._stall_s / 20.0, 0.01), 0.25)
        while True:
            await asyncio.sleep(poll)
            now = time.monotonic()
            for index, task in enumerate(self._tasks):
                if not task.done() and not self._stalled[index] and now - self._last[index] > self._stall_s:
                    self._stalled[index] = True
                    task.cancel()

    def close(self) -> None:
        """End every stream (no losses are reported after this) and the reader's thread."""
        stop_from_outside(self._loop, self._stop)
        self._thread.join(timeout=10.0)


class HeartbeatReader:
    """Reads ``configs[r]``'s Health stream for every rank ``r`` and calls ``on_beat(r, beat)``
    for each beat and ``on_lost(r, reason)`` once when a stream is lost (both on the reader's
    thread: keep them short). ``close()`` ends every stream without reporting losses."""

    _on_beat: OnBeat
    _streams: StreamReader

    def __init__(self, configs: Sequence[ClientConfig], *, interval_s: float, stall_s: float, on_beat: OnBeat,
                 on_lost: OnLost) -> None:
        check_timeout("interval_s", interval_s)
        self._on_beat = on_beat
        self._streams = StreamReader([health_target(c, interval_s) for c in configs], stall_s=stall_s,
                                     on_message=self._beat, on_lost=on_lost)

    def _beat(self, rank: int, message: owner_pb2.Heartbeat) -> None:
        self._on_beat(rank, heartbeat_of(message))

    def close(self) -> None:
        """End every stream (no losses are reported after this) and the reader's thread."""
        self._streams.close()
