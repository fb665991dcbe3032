"""A relay hop's calls to its children, every one on one asyncio loop in one thread (issue 44).

gRPC's blocking API runs a call made with ``.future()`` on a thread of the channel's own,
started for the call and ended with it: a hop over 8 owners started 8 threads a step and burnt
4.7-5.6 ms of CPU per RelayStep (``python -m benchmarks.relay_hop``), most of it in starting
them and in their contention for the GIL. Here each child has a ``grpc.aio`` channel, opened
once on the hop's loop, and a step's calls are tasks on that loop: one thread for the hop's
whole life, woken as replies arrive.

:class:`HopCalls` knows no records: it sends protobuf requests and hands back the replies or
the gRPC errors; the hop converts both (control/relay_hop.py). Its thread starts with the first
batch, so a hop that is built and never called costs nothing. Closing closes the channels
(cancelling calls in flight: their batch comes back with them failed), then waits for gRPC's own
tasks before the loop closes (control/aio_loop.py: a late event for a closed loop prints
``Event loop is closed`` elsewhere).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from zero_ray.control.aio_loop import open_channel, run_then_close, stop_from_outside
from zero_ray.control.auth import bearer_metadata
from zero_ray.control.client_channel import ClientConfig, check_timeout
from zero_ray.errors import ConfigError, ControlError, RelayError, ZeroRayError

__all__ = ["CallOutcome", "CallTarget", "HopCalls", "UnaryMethod", "UnaryRequest"]

# How long a first batch waits for the loop's thread to open the channels (it takes milliseconds).
_START_S = 10.0
# How long past its wait a batch may take to come back: the loop ends the wait itself, so this is
# only for a loop starved of the CPU; past it every call still out counts as unanswered.
_LATE_S = 5.0
# How long close() waits for the loop's thread: closing channels and draining take milliseconds.
_JOIN_S = 10.0

# The unary method a child is called with, on a channel to it (a generated stub's, e.g.
# ``lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Step``).
RpcOf = Callable[[grpc.aio.Channel], Any]


@dataclass(frozen=True, kw_only=True)
class CallTarget:
    """A child the hop calls: where and how (its client's configuration: address, TLS, token)."""

    config: ClientConfig


@dataclass(frozen=True, kw_only=True)
class UnaryMethod:
    """A unary method a child is called with: its name (``"PartitionOwner.Step"``; each child's
    method object is made once, on first use, and kept by this name) and how to get it from a
    channel."""

    name: str
    rpc: RpcOf

    def __post_init__(self) -> None:
        if not self.name or not callable(self.rpc):
            raise ConfigError(f"UnaryMethod(name={self.name!r}) needs a name and a channel's unary method")


@dataclass(frozen=True, kw_only=True)
class UnaryRequest:
    """One child's request of a batch: the method, the message and its call's deadline."""

    method: UnaryMethod
    message: Any
    timeout_s: float

    def __post_init__(self) -> None:
        check_timeout("timeout_s", self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class CallOutcome:
    """How one child's call of a batch ended: its reply, or why it failed (a ``grpc.RpcError``, a
    RelayError when the hop closed under it, a ControlError when it could not be sent); neither
    when it was not answered within the batch's wait (it was then cancelled)."""

    reply: Any = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.reply is not None and self.error is not None:
            raise ConfigError("a call's outcome is its reply or its error, not both")


_UNANSWERED = CallOutcome()


class HopCalls:
    """Unary calls to ``targets`` (a channel each, opened on first use), sent in batches on one
    asyncio loop thread. Thread-safe: batches from several threads run side by side."""

    _targets: tuple[CallTarget, ...]
    _metadata: tuple[tuple[tuple[str, str], ...], ...]
    _lock: threading.Lock
    _closed: bool
    _loop: asyncio.AbstractEventLoop | None
    _thread: threading.Thread | None
    _ready: threading.Event
    _stop: asyncio.Event | None
    _channels: tuple[grpc.aio.Channel, ...]
    _rpcs: dict[tuple[int, str], Any]  # by (target, method name): made on the loop's thread, on first use
    _broken: BaseException | None

    def __init__(self, targets: Sequence[CallTarget]) -> None:
        self._targets = tuple(targets)
        self._metadata = tuple(bearer_metadata(t.config.credentials.token) for t in self._targets)
        self._lock = threading.Lock()
        self._closed = False
        self._loop = None
        self._thread = None
        self._ready = threading.Event()
        self._stop = None
        self._channels = ()
        self._rpcs = {}
        self._broken = None

    @property
    def thread(self) -> threading.Thread | None:
        """The loop's thread, once a batch started it."""
        return self._thread

    def call(self, requests: Sequence[UnaryRequest | None], wait_s: float) -> list[CallOutcome]:
        """Send ``requests[i]`` to target ``i`` (None: not sent; its outcome is unanswered), all at
        once, and wait at most ``wait_s`` for every reply; a call still out then is cancelled."""
        if len(requests) != len(self._targets):
            raise ConfigError(f"{len(requests)} requests for {len(self._targets)} targets: one each, None for none")
        loop = self._started()
        with self._lock:  # a batch is queued before close()'s stop, so the loop still runs it
            if self._closed:
                raise _closed_error()
            future = asyncio.run_coroutine_threadsafe(self._batch(requests, max(0.0, wait_s)), loop)
        try:
            return future.result(timeout=max(0.0, wait_s) + _LATE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the loop was starved: what had not come back counts as unanswered
            return [_UNANSWERED] * len(requests)
        except concurrent.futures.CancelledError:
            raise _closed_error() from None

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise _closed_error()
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run, args=(self._loop,), daemon=True,
                                                name="zero_ray-relay-hop")
                self._thread.start()
            loop = self._loop
        if not self._ready.wait(_START_S):
            raise RelayError(f"the relay hop's loop did not open its {len(self._targets)} channels within "
                             f"{_START_S:g}s; the process may be starved of CPU")
        if self._broken is not None:
            raise RelayError(f"the relay hop could not open its channels: {self._broken}") from self._broken
        return loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        run_then_close(loop, self._main(), "relay hop")

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        channels: list[grpc.aio.Channel] = []
        try:
            channels = [open_channel(t.config) for t in self._targets]
            self._channels = tuple(channels)
        except Exception as err:  # noqa: BLE001 - reported to every caller by _started
            self._broken = err
        finally:
            self._ready.set()
        if self._broken is None:
            await self._stop.wait()
        # Closing a channel cancels its calls in flight: their batches come back with them failed.
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
        # gRPC's poller thread ends with the last asyncio channel object, not its close().
        self._channels, self._rpcs = (), {}

    async def _batch(self, requests: Sequence[UnaryRequest | None], wait_s: float) -> list[CallOutcome]:
        started: list[asyncio.Future[Any] | None] = []
        calls: list[Any] = []
        for i, (metadata, request) in enumerate(zip(self._metadata, requests)):
            if request is None:
                started.append(None)
                calls.append(None)
                continue
            try:
                call = self._rpc(i, request.method)(request.message, timeout=request.timeout_s, metadata=metadata)
            except Exception as err:  # noqa: BLE001 - a channel closing under the batch: that call's failure
                started.append(_failed_future(err))
                calls.append(None)
                continue
            calls.append(call)
            started.append(asyncio.ensure_future(call))
        live = [f for f in started if f is not None]
        try:
            if live:
                await asyncio.wait(live, timeout=wait_s)
        except asyncio.CancelledError:  # the caller gave up on a starved loop: nothing of it stays out
            for call in calls:
                if call is not None:
                    call.cancel()
            for f in live:
                f.cancel()
            raise
        return [self._outcome(f, c) for f, c in zip(started, calls)]

    def _rpc(self, target: int, method: UnaryMethod) -> Any:
        key = (target, method.name)
        rpc = self._rpcs.get(key)
        if rpc is None:
            rpc = self._rpcs[key] = method.rpc(self._channels[target])
        return rpc

    @staticmethod
    def _outcome(future: asyncio.Future[Any] | None, call: Any) -> CallOutcome:
        if future is None:
            return _UNANSWERED
        if not future.done():  # still silent when the wait ended
            if call is not None:
                call.cancel()
            future.cancel()
            return _UNANSWERED
        if future.cancelled():
            return CallOutcome(error=_closed_error())
        err = future.exception()
        if err is None:
            return CallOutcome(reply=future.result())
        if isinstance(err, (grpc.RpcError, ZeroRayError)):
            return CallOutcome(error=err)
        return CallOutcome(error=ControlError(f"the call failed before it was sent: {type(err).__name__}: {err}"))

    def close(self) -> None:
        """Cancel the calls in flight, close the channels and end the loop's thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._ready.wait(_START_S)  # the stop event exists once the loop is ready
        stop_from_outside(loop, self._stop)
        if thread is not threading.current_thread():  # a finalizer may run on the loop's own thread
            thread.join(timeout=_JOIN_S)


def _closed_error() -> RelayError:
    return RelayError("the relay hop was closed: its calls were cancelled and it sends no more; build a new hop "
                      "from the RelayTree to go on")


def _failed_future(err: BaseException) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_exception(err)
    return future
