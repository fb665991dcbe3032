"""The stream and event logic of CommStream behind DeviceSync, with CPU stand-ins: a recording
sync (who calls what, on which thread, in which order) and a simulated device whose compute
kernels run later, as a GPU's do, so that a collective unordered against them reads stale data."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from zero_ray.collective.device_sync import HostSync, device_sync
from zero_ray.collective.collective_api import ByteCounters
from zero_ray.collective.stream import CommStream


class _Group:
    """Two ranks' worth of protocol, run by one: records what each collective saw and where."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.counters = ByteCounters()
        self.seen: list[tuple[str, list[float], str]] = []

    def all_reduce_(self, buf: torch.Tensor) -> None:
        self.seen.append(("all_reduce", buf.tolist(), threading.current_thread().name))
        buf.mul_(2)  # as if the peer held the same values

    def all_gather_(self, buf: torch.Tensor, *, op: str = "all_gather") -> None:
        self.seen.append((op, buf.tolist(), threading.current_thread().name))

    def all_reduce_values(self, values: list[float]) -> list[float]:
        self.seen.append(("scalars", list(values), threading.current_thread().name))
        return [2 * v for v in values]


class _RecordingSync:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self._marks = 0

    def mark(self) -> int:
        self._marks += 1
        self.calls.append(("mark", self._marks, threading.current_thread().name))
        return self._marks

    def before(self, token: Any) -> None:
        self.calls.append(("before", token, threading.current_thread().name))

    def after(self) -> None:
        self.calls.append(("after", None, threading.current_thread().name))

    def computing(self) -> Any:
        raise AssertionError("CommStream never enters compute")


def test_every_job_is_marked_on_submit_and_ordered_on_the_comm_thread() -> None:
    sync, group = _RecordingSync(), _Group()
    stream = CommStream(group, sync=sync, name="comm")  # type: ignore[arg-type]
    buf = torch.ones(4)
    order: list[str] = []

    def job(tag: str) -> Callable[[], str]:
        def run() -> str:
            order.append(tag)
            sync.calls.append(("job", tag, threading.current_thread().name))
            return tag
        return run

    futures = [stream.submit(job("a")), stream.submit(job("b"))]
    assert [f.result(timeout=10) for f in futures] == ["a", "b"]
    stream.all_gather(buf, op="publish")  # from this (the compute) thread: a job of its own
    stream.close()
    me = threading.current_thread().name
    marks = [c for c in sync.calls if c[0] == "mark"]
    assert [c[2] for c in marks] == [me] * 3  # recorded where the inputs were produced
    comm = [c for c in sync.calls if c[0] != "mark"]
    assert {c[2] for c in comm} == {"comm"}
    # each job between the wait for its own mark and the completion wait
    assert [(c[0], c[1]) for c in comm] == [("before", 1), ("job", "a"), ("after", None), ("before", 2),
                                            ("job", "b"), ("after", None), ("before", 3), ("after", None)]
    assert group.seen == [("publish", [1.0] * 4, "comm")]


def test_compute_thread_collectives_run_on_the_comm_thread_and_world_size_one_runs_nothing() -> None:
    group = _Group()
    stream = CommStream(group, name="comm")  # type: ignore[arg-type]
    assert stream.all_reduce_values([1.0, 2.5]) == [2.0, 5.0]
    stream.close()
    assert group.seen == [("scalars", [1.0, 2.5], "comm")]
    solo = _Group()
    solo.world_size = 1
    inline = CommStream(solo)  # type: ignore[arg-type]
    assert inline.all_reduce_values([3.0]) == [3.0]
    inline.all_gather(torch.ones(2), op="x")
    assert solo.seen == []


class _SimDevice:
    """A compute stream whose kernels run on a device thread only once released, like queued
    CUDA kernels; ``mark`` is an event completed when the kernels queued before it have run."""

    def __init__(self) -> None:
        self._kernels: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._gate = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._gate.wait()
        while (kernel := self._kernels.get()) is not None:
            kernel()

    def launch(self, kernel: Callable[[], None]) -> None:
        self._kernels.put(kernel)

    def release(self) -> None:
        self._gate.set()

    def stop(self) -> None:
        self._kernels.put(None)
        self._gate.set()
        self._thread.join(timeout=10)


class _SimSync(HostSync):
    """DeviceSync for the simulated device: the comm thread waits for the mark's event."""

    def __init__(self, device: _SimDevice) -> None:
        self.device = device

    def mark(self) -> threading.Event:
        event = threading.Event()
        self.device.launch(event.set)
        return event

    def before(self, token: Any) -> None:
        assert token.wait(timeout=10), "the compute stream never reached the mark"


@pytest.mark.parametrize("ordered", [True, False])
def test_a_collective_reads_its_input_only_after_the_kernel_that_wrote_it(ordered: bool) -> None:
    device, group = _SimDevice(), _Group()
    stream = CommStream(group, sync=_SimSync(device) if ordered else HostSync())  # type: ignore[arg-type]
    grads = torch.zeros(3)
    device.launch(lambda: grads.fill_(1.5))  # backward's kernel, queued, not yet run
    done = stream.submit(lambda: group.all_reduce_(grads))
    if ordered:
        device.release()  # the device runs the kernel; only then may the collective read
        done.result(timeout=10)
        assert group.seen[0][1] == [1.5, 1.5, 1.5]
        assert grads.tolist() == [3.0, 3.0, 3.0]
    else:
        done.result(timeout=10)  # the unordered collective has already read the buffer
        assert group.seen[0][1] == [0.0, 0.0, 0.0]  # stale: what the ordering prevents
        device.release()
    stream.close()
    device.stop()


def test_a_cpu_owner_gets_the_host_sync() -> None:
    sync = device_sync(torch.device("cpu"))
    assert isinstance(sync, HostSync)
    assert sync.mark() is None
    with sync.computing():
        pass
