"""DeviceSync: how collectives on the communication thread are ordered against compute.

An owner computes on one thread and runs its collectives on another (``CommStream``). On a CPU
both threads act on memory at once, so a job that starts after its inputs were written sees
them, and a future that has resolved means the data is there. On CUDA, kernels only *queue*
work; three orderings must be made explicit:

1. input: a collective must run after the kernels that produced its input. ``mark()`` records
   an event on the compute stream when the job is submitted; ``before(token)`` makes the
   communication thread's stream wait for it (a device-side wait: the compute thread goes on).
2. output: whoever consumes a collective's result learns of it from the job's future.
   ``after()`` returns only when everything the job queued is complete on the device, so a
   resolved future means the data is there, as on a CPU.
3. lifetime: a tensor a collective reads or writes stays referenced by the job until its future
   resolves, and by then the device is done with it, so the caching allocator may hand its memory
   to anyone (no ``record_stream`` needed).

Why these suffice with Ray's NCCL group: it runs each collective on a *blocking* stream of its
own pool after waiting for an event on cupy's current stream, and copies results with torch on
the caller's current stream. On the communication thread both are the legacy default stream,
which CUDA orders against every blocking stream; so within that thread Ray's streams and ours
are ordered, and ``mark``/``before``/``after`` order the thread against compute, which runs on
a non-blocking side stream (``computing()``) so that it can overlap with communication.

``HostSync`` is the CPU implementation (nothing to do); ``CudaSync`` the CUDA one. Tests drive
``CommStream`` with a simulated device that queues work the way a GPU does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class DeviceSync(Protocol):
    """Orders one owner's collectives against its compute (see the module docstring)."""

    def mark(self) -> Any:
        """On the submitting thread: a token for the work queued so far (None when nothing
        needs waiting for)."""
        ...

    def before(self, token: Any) -> None:
        """On the communication thread, before a job: order the job after ``token``."""
        ...

    def after(self) -> None:
        """On the communication thread, after a job: return once its work is complete."""
        ...

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Around a step's compute on the compute thread (its stream current, and the default
        stream ordered after it on exit, so code outside the step sees the results)."""
        ...


class HostSync:
    """CPU: operations complete when they return; nothing to order."""

    def mark(self) -> None:
        return None

    def before(self, token: Any) -> None:
        return None

    def after(self) -> None:
        return None

    def computing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CudaSync:
    """CUDA: compute on a side stream of its own, collectives on the communication thread's
    default stream (and Ray's NCCL streams behind it), CUDA events between them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # torch's streams are non-blocking: the legacy default stream does not serialize them,
        # so compute can overlap with the NCCL kernels the default stream orders.
        self.compute = torch.cuda.Stream(device=device)

    def mark(self) -> list[torch.cuda.Event]:
        # The compute stream, and the caller's current one where that differs: jobs are
        # submitted from the step (compute stream, or autograd's thread running the step's
        # kernels on it) and from outside it (the default stream, e.g. after a restore).
        events = []
        for stream in {self.compute, torch.cuda.current_stream(self.device)}:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def before(self, token: Any) -> None:
        stream = torch.cuda.current_stream(self.device)
        for event in token or ():
            stream.wait_event(event)

    def after(self) -> None:
        # Recorded on the communication thread's stream (the legacy default stream), the event
        # follows every kernel Ray queued on its blocking NCCL streams.
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        default = torch.cuda.default_stream(self.device)
        self.compute.wait_stream(default)  # what was written outside steps (a restore, a reshard)
        try:
            with torch.cuda.stream(self.compute):
                yield
        finally:
            default.wait_stream(self.compute)


def device_sync(device: torch.device) -> DeviceSync:
    """The synchronization an owner on ``device`` needs."""
    return CudaSync(device) if device.type == "cuda" else HostSync()
