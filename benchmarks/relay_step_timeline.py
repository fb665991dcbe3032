"""Where ``step()``'s wall time goes on the relay tree (issue 44): each phase of a step timed on
the driver, at 1,024 owners with the stand-ins of ``benchmarks.control_scale --stand-in``.

    python -m benchmarks.relay_step_timeline [--owners 1024] [--steps 40]

The driver's path is timed where it hands the step on (every clock is the machine's monotonic
one, which the stand-ins' replies also carry): the packed request built on the calling thread,
the ``zero_ray-relay-plane`` thread's ``RelayHop.relay_step`` begun and its children's requests
built, the hop's loop thread beginning the batch and ending it, the hop's call back on the plane
thread, the reply combined there, and ``collect`` returning on the calling thread. Between the
batch's start and its end lie the other processes: the top relays' hops and the stand-ins, whose
reply says when the last subtree began and ended its 20 ms. Prints the median and the p10-p90
of each phase's time since ``step()`` began and of the gaps between them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# The phases, in the order a step passes them (the stand-ins' two from their reply).
PHASES = ("request built (caller)", "relay_step begun (plane thread)", "child requests built (plane thread)",
          "batch begun (hop loop)", "last subtree began (stand-in)", "last subtree ended (stand-in)",
          "batch done (hop loop)", "hop call returned (plane thread)", "reply combined (plane thread)",
          "collect returned (caller)")


def summarize(rows: Sequence[dict[str, float]]) -> list[tuple[str, float, float, float]]:
    """Per phase, then per gap between consecutive phases ("a -> b"): (name, median, p10, p90)
    of ``rows`` (ms since the step began, one dict per step)."""
    def spread(name: str, values: list[float]) -> tuple[str, float, float, float]:
        values = sorted(values)
        return name, statistics.median(values), values[len(values) // 10], values[(9 * len(values)) // 10]

    out = [spread(p, [r[p] for r in rows]) for p in PHASES]
    out += [spread(f"{a} -> {b}", [r[b] - r[a] for r in rows]) for a, b in zip(PHASES, PHASES[1:])]
    return out


def _timed(marks: dict[str, float]) -> None:
    """Wrap the driver's hand-off points so that each notes its phase's first time in ``marks``."""
    from zero_ray.control import hop_calls, relay_hop
    from zero_ray.driver.batch_staging import StepCommand

    def around(owner: Any, name: str, before: str | None, after: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                marks.setdefault(before, time.monotonic())
            out = inner(*args, **kwargs)
            marks.setdefault(after, time.monotonic())
            return out
        setattr(owner, name, wrapper)

    around(StepCommand, "relayed", None, PHASES[0])
    around(relay_hop.RelayHop, "relay_step", PHASES[1], PHASES[8])
    around(hop_calls.HopCalls, "call", PHASES[2], PHASES[7])
    batch: Callable[..., Any] = hop_calls.HopCalls._batch

    async def timed_batch(self: Any, *args: Any) -> Any:
        marks.setdefault(PHASES[3], time.monotonic())
        out = await batch(self, *args)
        marks.setdefault(PHASES[6], time.monotonic())
        return out
    hop_calls.HopCalls._batch = timed_batch  # type: ignore[method-assign]


def measure(owners: int, steps: int, warmup: int = 3) -> list[dict[str, float]]:
    """``steps`` timed steps (after ``warmup``) through a stand-in tree of ``owners``: each step's
    phases in ms since it began."""
    from benchmarks.control_measure import Driver, ScaleSettings
    from benchmarks.control_standin import StandInCluster

    marks: dict[str, float] = {}
    _timed(marks)
    settings = ScaleSettings(compute_s=0.02, steps=steps, warmup=warmup, per_process=128, heartbeat_window_s=1.0,
                             health_interval_s=2.5, health_timeout_s=30.0, probe_calls=8, relay_fan_out=8,
                             owners_per_node=8, stand_in=True)
    cluster = StandInCluster(owners, fan_out=8, owners_per_node=8, compute_s=settings.compute_s)
    driver = Driver(cluster, settings)
    rows: list[dict[str, float]] = []
    try:
        driver.start_monitor()
        for k in range(warmup + steps):
            marks.clear()
            wall, _, [(t0, [reply])] = driver.step(k)
            if k < warmup:
                continue
            row = {p: (marks[p] - t0) * 1e3 for p in PHASES if p in marks}
            row[PHASES[4]] = (reply.data_seconds - t0) * 1e3
            row[PHASES[5]] = (reply.compute_seconds - t0) * 1e3
            row[PHASES[9]] = wall * 1e3
            rows.append(row)
    finally:
        driver.close()
        cluster.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> list[tuple[str, float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    table = summarize(measure(args.owners, args.steps))
    print(f"{args.owners} owners, {args.steps} steps: ms since step() began, median [p10-p90]")
    for name, median, p10, p90 in table:
        print(f"  {name:80s} {median:7.2f}  [{p10:.2f}-{p90:.2f}]")
    return table


if __name__ == "__main__":
    main()
