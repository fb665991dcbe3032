"""Every owner's heartbeat stream, read on one asyncio loop in one thread.

A blocking stream needs a thread to wait in it: with a thread per owner the driver spent 1.33 s
of CPU per step at 1,024 owners on those threads alone (``benchmarks.control_scale``), each one
waking once per beat and contending for the GIL with the step. Here each stream is a task on one
loop (``grpc.aio``), and one task checks every stream's stall bound per tick.

A stream is lost when it ends with an error (the owner died: its sockets closed), when the
server ends it, or when no beat arrives for ``stall_s`` (a frozen process keeps its sockets).

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

import grpc

from zero_ray.control._generated import owner_pb2, owner_pb2_grpc
from zero_ray.control.aio_loop import open_channel, run_then_close, stop_from_outside
from zero_ray.control.auth import bearer_metadata
from zero_ray.control.client_channel import ClientConfig, check_timeout, convert_error, header_of
from zero_ray.control.handlers import Heartbeat
from zero_ray.control.conversion import to_record

OnBeat = Callable[[int, Heartbeat], None]
OnLost = Callable[[int, str], None]


class HeartbeatReader:
    """Reads ``configs[r]``'s Health stream for every rank ``r`` and calls ``on_beat(r, beat)``
    for each beat and ``on_lost(r, reason)`` once when a stream is lost (both on the reader's
    thread: keep them short). ``close()`` ends every stream without reporting losses."""

    def __init__(self, configs: Sequence[ClientConfig], *, interval_s: float, stall_s: float, on_beat: OnBeat,
                 on_lost: OnLost) -> None:
        check_timeout("interval_s", interval_s)
        check_timeout("stall_s", stall_s)
        self._configs = list(configs)
        self._interval_s, self._stall_s = interval_s, stall_s
        self._on_beat, self._on_lost = on_beat, on_lost
        n = len(self._configs)
        self._last = [time.monotonic()] * n  # when each stream last delivered (or opened)
        self._stalled = [False] * n
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="zero_ray-heartbeats")
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self) -> None:
        run_then_close(self._loop, self._main(), "heartbeat")

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        channels = [open_channel(c) for c in self._configs]
        self._tasks = [asyncio.create_task(self._watch(r, ch)) for r, ch in enumerate(channels)]
        watchdog = asyncio.create_task(self._stalls())
        self._ready.set()
        await self._stop.wait()
        self._closing = True
        for task in (*self._tasks, watchdog):
            task.cancel()
        await asyncio.gather(*self._tasks, watchdog, return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)

    async def _watch(self, rank: int, channel: grpc.aio.Channel) -> None:
        config = self._configs[rank]
        where = f"PartitionOwner.Health to {config.address}"
        request = owner_pb2.HealthRequest(header=header_of(config),
                                          interval_ms=max(1, round(self._interval_s * 1000)))
        call = owner_pb2_grpc.PartitionOwnerStub(channel).Health(
            request, metadata=bearer_metadata(config.credentials.token))
        self._last[rank] = time.monotonic()
        try:
            async for beat in call:
                self._last[rank] = time.monotonic()
                self._on_beat(rank, to_record(beat, Heartbeat))
            reason = f"{where} ended: the server stopped streaming (shutting down?)"
        except asyncio.CancelledError:
            call.cancel()
            if not self._stalled[rank] or self._closing:
                raise
            reason = f"{where} sent nothing for {self._stall_s:g}s (stall_s); the stream was cancelled"
        except grpc.aio.AioRpcError as err:
            reason = str(convert_error(where, err, None))
        if not self._closing:
            self._on_lost(rank, reason)

    async def _stalls(self) -> None:
        # The poll is what a stall's detection may lag by: stall_s / 20, between 10 and 250 ms.
        poll = min(max(self._stall_s / 20.0, 0.01), 0.25)
        while True:
            await asyncio.sleep(poll)
            now = time.monotonic()
            for rank, task in enumerate(self._tasks):
                if not task.done() and not self._stalled[rank] and now - self._last[rank] > self._stall_s:
                    self._stalled[rank] = True
                    task.cancel()

    def close(self) -> None:
        """End every stream (no losses are reported after this) and the reader's thread."""
        stop_from_outside(self._loop, self._stop)
        self._thread.join(timeout=10.0)

