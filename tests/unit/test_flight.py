"""The flight recorder and the stall diagnosis: which rank a stalled step waits for, never one
that waits on it (pure records; the recorder from threads)."""

from __future__ import annotations

import threading

import torch

from zero_ray.collective.flight_recorder import FlightRecorder, RecordedGroup
from zero_ray.collective.collective_api import SoloGroup
from zero_ray.control.handlers import CollectiveEvent, Flight
from zero_ray.core.stall_diagnosis import IDLE, diagnose

G = "zr-run-g3"


def _done(seq: int, op: str = "reduce_scatter") -> CollectiveEvent:
    return CollectiveEvent(op=op, group=G, seq=seq, nbytes=4096, started=100.0 + seq, ended=100.5 + seq)


def _rank(rank: int, *, phase: str, history: int, waiting_in: int | None = None, now: float = 140.0) -> Flight:
    current = (CollectiveEvent(op="reduce_scatter", group=G, seq=waiting_in, nbytes=4096, started=118.0)
               if waiting_in is not None else None)
    return Flight(rank=rank, phase=phase, phase_since=118.0, now=now, current=current,
                  recent=tuple(_done(s) for s in range(1, history + 1)))


def test_the_rank_in_compute_is_named_and_the_ranks_waiting_on_it_are_not() -> None:
    flights = [_rank(0, phase="backward (step 4, micro-batch 0)", history=11, waiting_in=12),
               _rank(1, phase="forward (step 4, micro-batch 0)", history=11),
               _rank(2, phase="backward (step 4, micro-batch 0)", history=11, waiting_in=12)]
    d = diagnose(flights)
    assert d.stuck == (1,) and d.waiting == (0, 2)
    assert d.collective is not None and (d.collective.op, d.collective.seq) == ("reduce_scatter", 12)
    text = d.text()
    assert text.startswith("rank(s) [1] diverged: not in reduce_scatter #12 on zr-run-g3, which ranks [0, 2] wait in")
    assert "rank 1: in forward (step 4, micro-batch 0) for 22.0s, in no collective" in text
    assert "rank 0: waiting in reduce_scatter #12 on zr-run-g3 (4096 bytes) for 22.0s" in text


def test_ranks_whose_collective_already_timed_out_still_point_at_the_stuck_one() -> None:
    # collective_timeout_s < step_timeout_s: the waiting ranks' collective #12 ended (failed), they are idle
    waited = [Flight(rank=r, phase=IDLE, phase_since=130.0, now=140.0, recent=tuple(_done(s) for s in range(1, 13)))
              for r in (0, 2)]
    d = diagnose([*waited, _rank(1, phase="waiting for data (step 4)", history=11)])
    assert d.stuck == (1,) and d.waiting == (0, 2)


def test_a_rank_that_ended_its_step_with_an_error_is_not_blamed() -> None:
    flights = [_rank(0, phase="backward", history=11, waiting_in=12), _rank(1, phase=IDLE, history=11)]
    assert diagnose(flights).stuck == ()


def test_no_rank_diverged_when_every_rank_is_in_compute_or_the_ring_is_empty() -> None:
    assert diagnose([_rank(0, phase="forward", history=5), _rank(1, phase="forward", history=5)]).stuck == ()
    empty = diagnose([Flight(rank=0, phase="forward", phase_since=1.0, now=2.0)], unreachable=[1])
    assert empty.stuck == () and empty.lines[-1] == "rank 1: did not answer"
    assert empty.text().startswith("no rank diverged")


def test_the_recorder_shows_a_collective_in_flight_to_another_thread() -> None:
    recorder = FlightRecorder(ring=4)
    inside, release = threading.Event(), threading.Event()

    def blocked() -> None:
        with recorder.collective("all_gather", "g", 8):
            inside.set()
            release.wait(10)

    for _ in range(5):  # seq 1..5, the ring keeps 4
        with recorder.collective("reduce_scatter", "g", 64):
            pass
    recorder.phase("backward")
    t = threading.Thread(target=blocked)
    t.start()
    assert inside.wait(10)
    snap = recorder.snapshot()
    release.set()
    t.join(10)
    assert snap.current is not None and (snap.current.op, snap.current.seq, snap.current.ended) == ("all_gather", 6, None)
    assert [e.seq for e in snap.recent] == [2, 3, 4, 5] and snap.phase == "backward"
    after = recorder.snapshot()
    assert after.current is None and after.recent[-1].seq == 6 and after.recent[-1].ended is not None


def test_a_recorded_group_records_every_operation_by_its_name() -> None:
    recorder = FlightRecorder()
    group = RecordedGroup(SoloGroup(), recorder, name="solo")
    buf = torch.zeros(4)
    group.reduce_scatter_(buf, op="grads")
    group.all_gather_(buf)
    group.all_reduce_values([1.0, 2.0])
    group.barrier()
    assert [(e.op, e.seq, e.nbytes) for e in recorder.snapshot().recent] == [
        ("grads", 1, 16), ("all_gather", 2, 16), ("all_reduce_values", 3, 16), ("barrier", 4, 0)]
    assert group.world_size == 1 and group.counters is group.inner.counters
