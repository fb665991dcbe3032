"""CommStream: one background thread that owns a group's collectives while compute runs.

The ring collectives in ``ray_group`` block their caller. Stage 3 overlaps them with compute
(the next unit's all-gather while the current unit runs), so they are submitted here and run
one at a time, in submission order, on a single thread. Every rank submits the same
collectives in the same order (the decisions are made on the compute thread from state that
is identical on every rank), which is all a ring needs. With world size 1 nothing is sent and
jobs run inline.

Every collective of a step runs on that thread, whoever asks for it (a job, or the compute
thread through ``run``), and ``DeviceSync`` orders each job against compute: on CUDA after the
kernels that produced its input, and its future resolved only once its result is on the device.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from zero_ray.collective.device_sync import DeviceSync, HostSync
from zero_ray.collective.collective_api import Collective

T = TypeVar("T")

_STOP = object()


class CommStream:
    """A FIFO of collective jobs on one daemon thread (a daemon, so that a job blocked on a dead
    peer cannot keep the process alive; every collective wait is bounded anyway)."""

    def __init__(self, group: Collective, *, sync: DeviceSync | None = None, name: str = "zero_ray-comm") -> None:
        self.group = group
        self.sync: DeviceSync = sync if sync is not None else HostSync()
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: deque[Future[Any]] = deque()
        self._failure: BaseException | None = None  # of the first failed job since the last drain
        self._thread: threading.Thread | None = None
        if group.world_size > 1:
            self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future, token = job
            if not future.set_running_or_notify_cancel():
                continue
            if self._failure is not None:
                # After a failed collective the group is broken: later ones would only wait out
                # their timeouts (or pair with the wrong messages), so they fail with its error.
                future.set_exception(self._failure)
                continue
            try:
                self.sync.before(token)
                result = fn()
                self.sync.after()
                future.set_result(result)
            except BaseException as err:  # delivered to whoever waits on the future
                self._failure = err
                future.set_exception(err)

    # -- submission ---------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` after everything submitted before it; returns its future."""
        future: Future[T] = Future()
        if self._thread is None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)
            return future
        # Forget jobs that have succeeded; a failed one stays until drain() reports it.
        while self._pending and self._pending[0].done() and not self._pending[0].cancelled() \
                and self._pending[0].exception() is None:
            self._pending.popleft()
        self._pending.append(future)
        self._jobs.put((fn, future, self.sync.mark()))
        return future

    def run(self, fn: Callable[[], T]) -> T:
        """Submit ``fn`` and wait for it."""
        return self.submit(fn).result()

    def drain(self) -> None:
        """Wait for every job submitted so far; raise the first failure (the jobs queued after
        a failure are not run: they fail with the same error). The stream is usable again
        afterwards, e.g. on a re-formed group."""
        first: BaseException | None = None
        while self._pending:
            future = self._pending.popleft()
            if future.cancelled():
                continue
            err = future.exception()
            if err is not None and first is None:
                first = err
        self._failure = None
        if first is not None:
            raise first

    def drain_quietly(self) -> None:
        """Wait for every submitted job, ignoring failures (after an aborted step)."""
        try:
            self.drain()
        except BaseException:  # the step that failed has already reported it
            self._pending.clear()

    def cancel(self) -> None:
        """Cancel every job that has not started and wait for the one running, ignoring
        failures: how an interrupted micro-batch's collectives are abandoned. The wait is as
        bounded as the running collective (at once on an aborted group)."""
        for future in self._pending:
            future.cancel()
        self.drain_quietly()

    # -- collectives by label -------------------------------------------------------------------
    def _here(self) -> bool:
        return threading.current_thread() is self._thread

    def all_gather(self, buf: torch.Tensor, *, op: str) -> None:
        """All-gather ``buf`` in place, counting the bytes under ``op`` (inside a job, or from
        the compute thread: then as a job of its own, waited for)."""
        if self.group.world_size == 1:
            return
        if self._here():
            self.group.all_gather_(buf, op=op)
        else:
            self.run(lambda: self.group.all_gather_(buf, op=op))

    def all_reduce_values(self, values: list[float]) -> list[float]:
        """Sum a few control scalars across ranks (from the compute thread; waited for)."""
        if self.group.world_size == 1:
            return list(values)
        return self.run(lambda: self.group.all_reduce_values(values))

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], *,
                  op: str) -> None:
        """Point-to-point messages (``Collective.send_recv``), as a job waited for."""
        if sends or recvs:
            self.run(lambda: self.group.send_recv(sends, recvs, op=op))

    def reduce_scatter(self, buf: torch.Tensor, *, op: str) -> torch.Tensor:
        """Reduce-scatter ``buf`` in place; this rank's summed chunk (call on the stream)."""
        if self.group.world_size == 1:
            return buf
        return self.group.reduce_scatter_(buf, op=op)

    def all_reduce(self, buf: torch.Tensor) -> None:
        """All-reduce ``buf`` in place (call on the stream)."""
        if self.group.world_size > 1:
            self.group.all_reduce_(buf)

    # -- lifecycle ----------------------------------------------------------------------------------
    def rebind(self, group: Collective) -> None:
        """Use ``group`` for jobs from now on (after the old group's jobs have finished)."""
        self.drain_quietly()
        self.group = group
        if group.world_size > 1 and self._thread is None:
            self._start()

    def close(self) -> None:
        self.drain_quietly()
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread = None
