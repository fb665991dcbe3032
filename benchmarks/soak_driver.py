"""The soak's training driver (benchmarks/soak.py starts it; it is the process ``driver_sigkill``
SIGKILLs). Not run by hand:

    python -m benchmarks.soak_driver SPEC_JSON [--attach RUN_ID | --standby]

The first driver builds the trainer, warms up, measures the fault-free baselines, then runs
``fit`` in chunks under the fault injector (benchmarks/harness/soak_faults.py) until the soak's
minutes are up, with a round of fault-free calibration chunks every ``calibrate_every_s`` soak
seconds once no fault has been in flight for CALIBRATION_AFTER_S (the soak's clock stopped over
it: goodput's reference in the soak's own stretch of the machine's load).

A driver started with ``--attach`` takes a detached run over from the owners
(``ZeroTrainer.attach``) after its predecessor's SIGKILL, reads from the journal where the soak
stands (its clock, the faults fired, the size to keep) and goes on to the same end. A driver
started with ``--standby`` is one started ahead: it imports, connects to Ray, then waits for the
run id on its standard input (its supervisor writes it when it SIGKILLs the driver before it)
and attaches; an empty line (or stdin closed) ends it. Every event goes to the journal
(benchmarks/harness/soak_journal.py), which the supervisor reads; the last driver saves the
final parameters to a file and shuts the run down.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

SEQ, BATCH, SEED, WINDOW, BLOCK_TOKENS = 32, 12, 46, 4, 512
CHUNK, CHECKPOINT_EVERY, WARM_STEPS = 100, 50, 20
COLLECTIVE_TIMEOUT_S = 15.0
SHORT_CUT_S, LONG_CUT_S, DEGRADE_S = 5.0, 17.0, 20.0
OVERDUE_INTERVALS = 3  # a fault held longer than this many intervals is recorded as missed
# Every size the soak passes through: its resizes (4 <-> 3), a node's loss (2). The soak's own size
# last, so that its baseline is taken on the processes the soak starts with (owners started for
# the resizes back up among them), right before it.
BASELINE_SIZES = (3, 2, 4)
# A detached run's owners end themselves after this long without a driver: well above a new
# driver's start (a Python process, Ray's connection, attach) on a loaded machine.
ORPHAN_TIMEOUT_S = 120.0


# A calibration begins only this long after the last fault settled: the steps right after one
# (a replacement's first, the survivors' catching up) are the fault's time. The 30-minute soak
# of 2026-12-07 17:52 began one 0.2 s after a grow back, and its 100 steps took 98 ms at first
# and 300-500 ms at the end, against 85 ms before the soak and 110-130 ms in fault-free minutes.
CALIBRATION_AFTER_S = 20.0


class SoakClock:
    """Soak seconds: since ``t0``, less the time the calibrations took (fault-free chunks the soak
    neither counts nor schedules faults in; harness/goodput.Calibration). One clock for every
    driver: one that attaches starts from the journal's t0 and its calibrations."""

    t0: float
    paused_s: float

    def __init__(self, t0: float, paused_s: float = 0.0) -> None:
        self.t0, self.paused_s = t0, paused_s

    def now(self) -> float:
        return time.monotonic() - self.t0 - self.paused_s


def _calibrate(trainer: Any, source: Any, clock: SoakClock, journal: Any, other: int | None) -> None:
    """A round of fault-free chunks with the soak's clock stopped: one at the run's size, then,
    with ``other``, a resize there, WARM_STEPS and one at that size, and back (a resize and
    WARM_STEPS), so that sizes the run only passes through after faults (2 owners) get a reference
    from the soak's own stretch too. Valid (the clock stays stopped over the whole round) only when
    no recovery landed in it and the run ends it at its size."""
    from benchmarks.harness.goodput import Calibration, StepAt
    from benchmarks.harness.soak_journal import Journal

    home, recoveries, at = trainer.world_size, len(trainer.recoveries), clock.now()
    # Each step written down as the soak's are (to a file beside the journal, which its steps are
    # not), so that the reference pays the soak's per-step cost in this driver too.
    aside = Journal(journal.path + ".calibration")
    start, timed = time.monotonic(), []
    for size in (home,) if other is None else (home, other):
        if trainer.world_size != size:
            trainer.resize(size)
            _fit(trainer, source, trainer.step_count + WARM_STEPS)
        t = time.monotonic()
        _fit(trainer, source, trainer.step_count + CHUNK,
             lambda m: aside.step(StepAt(t_s=round(clock.now(), 3), step=m["step"], size=trainer.world_size)))
        timed.append((size, time.monotonic() - t))
    if trainer.world_size != home:  # back, even after a loss: the injector keeps the run at home
        trainer.resize(home)
        _fit(trainer, source, trainer.step_count + WARM_STEPS)
    took = round(time.monotonic() - start, 3)
    valid = trainer.world_size == home and len(trainer.recoveries) == recoveries
    for i, (size, s) in enumerate(timed):
        journal.write("calibration", asdict(Calibration(at_s=round(at, 3), size=size, steps=CHUNK, s=round(s, 3),
                                                        valid=valid, paused_s=took if i == 0 else 0.0)))
    if valid:
        clock.paused_s += took  # as the journal has it: an attaching driver sums the same


def gpt() -> Any:
    from zero_ray.models import GPT, GPTConfig

    return functools.partial(GPT, GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=2, n_embd=64))


def _fit(trainer: Any, source: Any, steps: int, callback: Any = None) -> None:
    trainer.fit(source, global_batch_size=BATCH, steps=steps, seed=SEED, checkpoint_every=CHECKPOINT_EVERY,
                progress=False, callback=callback)


def _first(spec: dict[str, Any], journal: Any, callbacks: list[Any]) -> tuple[Any, float]:
    """Build the run, warm up and measure the baselines; the trainer and the soak's start."""
    import zero_ray as zr
    from zero_ray.models import lm_loss

    world = spec["nodes"] * spec["cpus_per_node"]
    # Plain SGD at a small rate: float32 rounding that differs by world size (3, 2 owners after
    # losses) grows slowly over thousands of steps (lr 0.05, momentum 0.9 reached 9.8e-07 in 720).
    cfg = zr.ZeroConfig(stage=2, world_size=world, device="cpu", bucket_bytes=1 << 16,
                        health_timeout_s=spec["health_timeout_s"], health_interval_s=spec["health_interval_s"],
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S, max_failures=100_000,
                        elastic=zr.ElasticConfig(redundancy="peer", grow_check_s=1.0, max_world_size=world,
                                                 detached=spec["detached"], orphan_timeout_s=ORPHAN_TIMEOUT_S),
                        checkpoint=zr.CheckpointConfig(dir=f"s3://{spec['bucket']}/run", keep=100_000))
    trainer = zr.ZeroTrainer(gpt(), lm_loss, optimizer=zr.SGD(lr=0.02), config=cfg, callbacks=callbacks)
    journal.write("run", {"run_id": trainer.run_id, "pid": os.getpid()})
    source = _source(spec)
    _fit(trainer, source, WARM_STEPS)
    # Fault-free seconds a step at every size the soak may pass through, each after a warm-up at
    # that size: goodput credits every soak step with its own size's time (harness/goodput.py).
    baseline: dict[str, Any] = {}
    for size in BASELINE_SIZES:
        if trainer.world_size != size:
            trainer.resize(size)
            _fit(trainer, source, trainer.step_count + WARM_STEPS)
        t = time.perf_counter()
        for _ in range(spec["baseline_chunks"]):
            _fit(trainer, source, trainer.step_count + CHUNK)
        base_s = time.perf_counter() - t
        steps = spec["baseline_chunks"] * CHUNK
        baseline[str(size)] = {"steps": steps, "s": round(base_s, 2), "step_s": round(base_s / steps, 4)}
    journal.write("baseline", {"sizes": baseline, "recoveries": len(trainer.recoveries)})
    if trainer.world_size != world:
        trainer.resize(world)
    t0 = time.monotonic()
    journal.write("t0", t0)
    return trainer, t0


def _source(spec: dict[str, Any]) -> Any:
    import zero_ray as zr

    return zr.data.TokenFiles(f"s3://{spec['bucket']}/corpus/train-*.bin", seq_len=SEQ, block_tokens=BLOCK_TOKENS,
                              window=WINDOW)


def main() -> None:
    import ray

    import zero_ray as zr
    from benchmarks.harness.goodput import StepAt
    from benchmarks.harness.s3_remote import RemoteS3
    from benchmarks.harness.soak_faults import KINDS, Cluster, FaultRecord, Injector, schedule
    from benchmarks.harness.soak_journal import Attached, Journal, Recovered, read
    from zero_ray.models import lm_loss

    spec = json.loads(Path(sys.argv[1]).read_text())
    attach = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--attach" else None
    standby = len(sys.argv) > 2 and sys.argv[2] == "--standby"
    journal = Journal(spec["journal"])

    clock: list[SoakClock] = []  # the soak's, once known: events before it are the set-up's

    class Committed(zr.Callback):
        def on_checkpoint(self, path: str, step: int) -> None:
            journal.write("committed", [path, step])

        def on_event(self, text: str) -> None:
            # resizes (a grow back's seconds among them), recoveries, attaches: where a fault's time went
            if clock:
                journal.write("event", {"t_s": round(clock[0].now(), 3), "text": text})

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    if standby:
        attach = sys.stdin.readline().strip()
        if not attach:  # the soak ended without needing this driver
            ray.shutdown()
            return
    if attach is not None:  # the restore's split: this process' start and Ray's connection, then attach
        journal.write("ready", {"pid": os.getpid(), "at": time.monotonic()})
    if attach is None:
        trainer, t0 = _first(spec, journal, [Committed()])
        seen = len(trainer.recoveries)  # the baselines' resizes are not the soak's
        soak_clock, last_calibration = SoakClock(t0), 0.0
    else:
        trainer = zr.ZeroTrainer.attach(attach, gpt(), lm_loss, callbacks=[Committed()])
        before = read(spec["journal"])
        assert before.t0 is not None, "a driver attaches only once the soak has started"
        seen = 0  # the attach's own recovery (owners left mid-step) is the fault's
        soak_clock = SoakClock(before.t0, before.paused_s)
        last_calibration = max((c.at_s for c in before.calibrations), default=0.0)
        journal.write("run", {"run_id": trainer.run_id, "pid": os.getpid()})
        journal.write("attached", asdict(Attached(t_s=round(soak_clock.now(), 3), step=trainer.step_count,
                                                  pid=os.getpid())))
    clock.append(soak_clock)
    duration_s = spec["minutes"] * 60
    kinds = spec["kinds"]
    plan = [] if kinds == "none" else schedule(seed=spec["seed"], duration_s=duration_s,
                                               interval_s=spec["fault_interval_s"],
                                               kinds=tuple(kinds.split(",")) if kinds else KINDS)
    cluster = Cluster(far_namespace=spec["far_ns"], head_ip=spec["head_ip"],
                      s3=RemoteS3(spec["s3_socket"], bytes.fromhex(spec["s3_authkey"])),
                      corpus_pattern=f"^/{spec['bucket']}/corpus/", checkpoint_pattern=f"^/{spec['bucket']}/run/",
                      link_mbit=spec["link_mbit"], netem=spec["netem"], far_ip=spec["far_ip"],
                      cpus_per_node=spec["cpus_per_node"], disk=spec["disk"], disk_leave_bytes=spec["disk_leave_bytes"])
    injector = Injector(trainer, cluster, plan, seed=spec["seed"], sizes=(4, 3), short_cut_s=SHORT_CUT_S,
                        long_cut_s=LONG_CUT_S, degrade_s=DEGRADE_S, overdue_s=OVERDUE_INTERVALS * spec["fault_interval_s"])
    if attach is not None:
        got = read(spec["journal"])
        injector.resume([FaultRecord(**got.faults[i]) for i in sorted(got.faults)], got.size)
    written: dict[int, dict[str, Any]] = {}

    def report() -> None:
        """New recoveries and changed fault records to the journal."""
        nonlocal seen
        for r in trainer.recoveries[seen:]:
            journal.write("recovery", asdict(Recovered.of(r)))
        seen = len(trainer.recoveries)
        for i, rec in enumerate(injector.records):
            if written.get(i) != (now := asdict(rec)):
                journal.write("fault", {"index": i, "record": now, "size": injector.size})
                written[i] = now

    def tick(metrics: Any) -> None:
        elapsed = soak_clock.now()
        journal.step(StepAt(t_s=round(elapsed, 3), step=metrics["step"], size=trainer.world_size))
        if not injector.kill_requested:
            injector.tick(elapsed, metrics["step"])
        report()
        if injector.kill_requested and not written.get(-1):
            journal.write("kill", os.getpid())
            written[-1] = {"asked": True}

    source = _source(spec)
    load_before = os.getloadavg()
    every_s = spec["calibrate_every_s"]
    try:
        while soak_clock.now() < duration_s:
            if (every_s and soak_clock.now() - last_calibration >= every_s
                    and injector.quiet(soak_clock.now(), for_s=CALIBRATION_AFTER_S)):
                last_calibration = soak_clock.now()
                others = [n for n in BASELINE_SIZES if n != trainer.world_size]
                # One other size a round, in turn (a round's cost stays about two chunks).
                other = others[int(last_calibration // every_s) % len(others)] if others else None
                _calibrate(trainer, source, soak_clock, journal, other)
                continue
            _fit(trainer, source, trainer.step_count + CHUNK, tick)
    finally:
        injector.close()
    soak_s = soak_clock.now()
    report()
    state_path = os.path.join(os.path.dirname(spec["journal"]), "final.pt")
    import torch

    torch.save(trainer.full_state_dict(), state_path)
    journal.write("end", {"soak_s": round(soak_s, 2), "steps_total": trainer.step_count,
                          "samples_seen": trainer.samples_seen, "world_size_end": trainer.world_size,
                          "recoveries_last_driver": len(trainer.recoveries), "state": state_path,
                          "load_before": [round(x, 2) for x in load_before],
                          "load_after": [round(x, 2) for x in os.getloadavg()]})
    trainer.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
