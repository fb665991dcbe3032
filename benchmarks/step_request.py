"""What building one step's requests costs the driver (issue 44), directly and down the tree.

    python -m benchmarks.step_request [--owners 8,64,256,1024] [--repeats 50] [--json OUT]

A ``fit`` step over a dataset, cut for N owners as the controller cuts it
(``IndexedBatch.split``, one index per owner), then made into what goes on the wire:

- ``direct``: every owner's ``StepArgs`` (``StepCommand.per_rank``) converted to its
  ``StepRequest`` message, as the pool's direct fan-out sends them;
- ``relayed``: the one packed ``RelayStepArgs`` (``StepCommand.relayed``) cut for each of the
  driver's top relays (``for_ranks``, nodes of 8 owners, ``plan_relays`` at fan-out 8) and
  converted to its ``RelayStepRequest``, as ``RelayPlane`` and the driver's hop send them.

CPU time of this process (``time.process_time``), median over ``--repeats``; nothing is sent,
so the figures are the building alone, without gRPC's own cost per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

from zero_ray.control._generated import owner_pb2, relay_pb2
from zero_ray.control.conversion import to_message
from zero_ray.control.handlers import StepArgs
from zero_ray.core.relay_tree import RelayConfig, plan_relays
from zero_ray.driver.batch_staging import IndexedBatch, StepCommand

PER_NODE = 8


def _command(step: int, owners: int) -> StepCommand:
    out = IndexedBatch(dataset="train", indices=tuple(range(step * owners, (step + 1) * owners))).split(
        world_size=owners, key=f"0:{step}")
    return StepCommand(step=StepArgs(step=step, piece=out.piece, global_samples=owners, samples_seen=step * owners),
                       out=out)


def _median_ms(repeats: int, build: Callable[[int], object]) -> float:
    times = []
    for step in range(repeats):
        c0 = time.process_time()
        build(step)
        times.append(time.process_time() - c0)
    return statistics.median(times) * 1e3


def measure(owners: int, repeats: int) -> dict[str, float]:
    """The two ways' building cost for ``owners`` owners, in ms of CPU per step."""
    tree = plan_relays([f"node-{r // PER_NODE}" for r in range(owners)], RelayConfig())
    tops = [tree.ranks_under(c.id) for c in tree.driver_children]

    def direct(step: int) -> None:
        for args in _command(step, owners).per_rank():
            to_message(args, owner_pb2.StepRequest)

    def relayed(step: int) -> None:
        packed = _command(step, owners).relayed(timeout_s=60.0)
        for i, ranks in enumerate(tops):
            to_message(packed.for_ranks(ranks, timeout_s=59.5, relay=i), relay_pb2.RelayStepRequest)

    return {"owners": owners, "top_relays": len(tops), "direct_ms": _median_ms(repeats, direct),
            "relayed_ms": _median_ms(repeats, relayed)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_request", description=__doc__.split("\n")[0])
    parser.add_argument("--owners", default="8,64,256,1024", help="comma-separated owner counts")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(int(n), args.repeats) for n in args.owners.split(",")]
    print("| owners | top relays | direct: ms of CPU a step | relayed: ms of CPU a step |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['owners']} | {r['top_relays']} | {r['direct_ms']:.2f} | {r['relayed_ms']:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return rows


if __name__ == "__main__":
    main()
