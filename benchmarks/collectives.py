"""Collective micro-benchmark: zero_ray's ring reduce-scatter and all-gather (``RingGroup``)
against torch.distributed's gloo all-reduce of the same buffer on the same process group.

Every world size gets fresh one-CPU Ray actors (one torch thread each) that join one gloo group
through ``form_group``, as partition owners do. Per buffer size, each round runs every
operation once on every rank, in the same order (so noise on a shared machine hits all of them
alike), each started together after a barrier and timed on each rank; a round's time for an
operation is its slowest rank's (a collective has finished when every rank has). The report
gives the median, min and max over the rounds after the warm-up ones, and the ratio of each
operation's median to the all-reduce's. A ring reduce-scatter or all-gather sends half of what
a ring all-reduce does, so the ideal ratio is 0.5.

Pure parts (results, rendering) need no Ray; ``run_collectives`` starts Ray through
``runner.ensure_ray`` when none is connected.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness.report import fmt_bytes, machine_line
from benchmarks.harness.stats import Summary, summarise
from zero_ray.collective.ray_group import DIRECT_MAX_BYTES
from zero_ray.errors import ConfigError, ZeroRayError

log = logging.getLogger(__name__)

#: what is timed, in the order each round runs it; ``all_reduce`` is torch's gloo all-reduce,
#: ``ring_all_reduce`` zero_ray's own (reduce-scatter then all-gather, what stage 0 uses)
OPS: tuple[str, ...] = ("all_reduce", "ring_all_reduce", "reduce_scatter", "all_gather")
#: with ``--hops``, the parts a ring step is made of: one exchange of a 1/N chunk with the ring
#: neighbours, and the local add of a 1/N chunk (what a reduce-scatter step adds to it)
HOP_OPS: tuple[str, ...] = ("hop", "add")
BASELINE = "all_reduce"
#: the operations the issue holds to ``target`` x the all-reduce
TARGETED: tuple[str, ...] = ("reduce_scatter", "all_gather")
LABELS = {"all_reduce": "all-reduce (gloo)", "ring_all_reduce": "ring all-reduce", "reduce_scatter": "reduce-scatter",
          "all_gather": "all-gather", "hop": "one hop", "add": "one add"}
SCHEMA_VERSION = 1
BASENAME = "collectives"
DEFAULT_OUTPUT = os.path.join("benchmarks", "results")
_MIB = 2**20
_ELEMENT = 4  # float32


@dataclass(frozen=True, kw_only=True)
class CollectivesConfig:
    """What to time.

    sizes_mib: buffer sizes in MiB (float32; every rank holds one buffer of this size).
    world_sizes: ranks per group; each gets its own actors.
    rounds / warmup: timed rounds per size, and untimed ones before them.
    target: the largest reduce-scatter and all-gather ratio to the all-reduce that passes.
    hops: also time one ring hop and one add (``HOP_OPS``), to see where a collective's time goes.
    timeout_s: bound on every collective wait and every wait for the actors.
    """

    sizes_mib: tuple[int, ...] = (1, 4, 16, 64, 256)
    world_sizes: tuple[int, ...] = (2, 4)
    rounds: int = 11
    warmup: int = 2
    target: float = 0.55
    hops: bool = False
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name, values in (("sizes_mib", self.sizes_mib), ("world_sizes", self.world_sizes)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"{name}={values!r} must be a non-empty tuple of integers >= 1")
        small = [n for n in self.world_sizes if n < 2]
        if small:
            raise ConfigError(f"world_sizes={self.world_sizes!r}: a collective needs at least 2 ranks")
        for n in self.world_sizes:
            for mib in self.sizes_mib:
                if (mib * _MIB // _ELEMENT) % n:
                    raise ConfigError(f"{mib} MiB of float32 does not split into {n} equal chunks")
        for name, minimum in (("rounds", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
        for name in ("target", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class CollectiveRow:
    """One buffer size at one world size: milliseconds by operation (slowest rank per round)."""

    world_size: int
    size_bytes: int
    times_ms: dict[str, Summary]

    def __post_init__(self) -> None:
        if BASELINE not in self.times_ms:
            raise ConfigError(f"a row needs the {BASELINE} baseline; got {sorted(self.times_ms)}")

    def ratio(self, op: str) -> float:
        """``op``'s median over the all-reduce's."""
        return self.times_ms[op].median / self.times_ms[BASELINE].median

    def misses(self, target: float) -> list[str]:
        """The targeted operations whose ratio is above ``target``."""
        return [op for op in TARGETED if op in self.times_ms and self.ratio(op) > target]

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "size_bytes": self.size_bytes,
                "times_ms": {op: vars(s).copy() for op, s in self.times_ms.items()},
                "ratio_to_all_reduce": {op: round(self.ratio(op), 4) for op in self.times_ms if op != BASELINE}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CollectiveRow:
        return cls(world_size=data["world_size"], size_bytes=data["size_bytes"],
                   times_ms={op: Summary(**s) for op, s in data["times_ms"].items()})


@dataclass(frozen=True, kw_only=True)
class CollectivesResults:
    """A whole run: where it ran, with what settings, and one row per (world size, size)."""

    machine: dict[str, Any]
    settings: dict[str, Any]
    rows: tuple[CollectiveRow, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "machine": dict(self.machine), "settings": dict(self.settings),
                "rows": [r.to_dict() for r in self.rows], "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CollectivesResults:
        if data.get("schema") != SCHEMA_VERSION:
            raise ConfigError(f"results schema {data.get('schema')!r} is not {SCHEMA_VERSION}; rerun the benchmark")
        return cls(machine=data["machine"], settings=data["settings"],
                   rows=tuple(CollectiveRow.from_dict(r) for r in data["rows"]), notes=tuple(data.get("notes", ())))


# -- rendering ------------------------------------------------------------------------------------------
def _ms(s: Summary) -> str:
    return f"{s.median:.2f} ({s.min:.2f} – {s.max:.2f})" if s.median < 100 else \
        f"{s.median:.0f} ({s.min:.0f} – {s.max:.0f})"


def table_rows(results: CollectivesResults) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the table: times per operation, then ratios to the all-reduce."""
    ops = [op for op in OPS + HOP_OPS if any(op in r.times_ms for r in results.rows)]
    target = float(results.settings.get("target", CollectivesConfig.target))
    header = ["ranks", "buffer"] + [f"{LABELS[op]} ms" for op in ops]
    header += [f"{LABELS[op]} / all-reduce" for op in ops if op != BASELINE] + [f"≤ {target:g}x"]
    cells = []
    for r in results.rows:
        line = [str(r.world_size), fmt_bytes(r.size_bytes)]
        line += [_ms(r.times_ms[op]) if op in r.times_ms else "—" for op in ops]
        line += [f"{r.ratio(op):.2f}" if op in r.times_ms else "—" for op in ops if op != BASELINE]
        missed = r.misses(target)
        line.append("yes" if not missed else "no: " + ", ".join(LABELS[op] for op in missed))
        cells.append(line)
    return header, cells


def render_markdown(results: CollectivesResults) -> str:
    """The report: the machine line, the settings, the table and the notes."""
    s = results.settings
    header, cells = table_rows(results)
    out = ["# zero_ray collectives micro-benchmark", "", machine_line(results.machine, libraries=("torch", "ray")), "",
           f"gloo on CPU, float32, one CPU and one torch thread per rank (Ray actors); median (min – max) of "
           f"{s.get('rounds')} rounds after {s.get('warmup')} warm-up rounds, each operation timed from a "
           "barrier to its slowest rank's finish. all-reduce (gloo) is `torch.distributed.all_reduce` on the "
           "process group the ring runs over; ring all-reduce, reduce-scatter and all-gather are zero_ray's "
           "`RingGroup`: round the ring above "
           f"{fmt_bytes(s.get('direct_max_bytes', DIRECT_MAX_BYTES))} with more than 2 ranks, to every peer "
           "at once up to it (the ideal ratio of a reduce-scatter or all-gather to a ring all-reduce is 0.5)."
           + (" one hop: one ring step's exchange of a 1/N chunk; one add: the local add of a 1/N chunk."
              if s.get("hops") else ""), ""]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join(["---:"] * (len(header) - 1) + ["---"]) + "|")
    out += ["| " + " | ".join(c) + " |" for c in cells]
    notes = list(results.notes)
    if notes:
        out += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def write_results(results: CollectivesResults, output_dir: str) -> list[str]:
    """Write ``collectives.json`` and ``collectives.md`` under ``output_dir``; their paths."""
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, BASENAME)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(results.to_dict(), f, indent=2)
        f.write("\n")
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(render_markdown(results))
    return [stem + ".json", stem + ".md"]


def read_results(path: str) -> CollectivesResults:
    with open(path, encoding="utf-8") as f:
        return CollectivesResults.from_dict(json.load(f))


def target_notes(rows: Sequence[CollectiveRow], target: float) -> list[str]:
    """One note naming every (ranks, size, operation) above the target, or none."""
    missed = [f"{r.world_size} ranks / {fmt_bytes(r.size_bytes)} {LABELS[op]} ({r.ratio(op):.2f}x)"
              for r in rows for op in r.misses(target)]
    if not missed:
        return []
    return [f"above the {target:g}x target: " + "; ".join(missed) + " (see docs/performance.md for where the time goes)"]


def summarise_rounds(rounds: Sequence[Sequence[dict[str, float]]], *, warmup: int) -> dict[str, Summary]:
    """Per operation, milliseconds over the rounds after ``warmup``: each round's slowest rank.
    ``rounds[i][r]`` is rank ``r``'s seconds by operation in round ``i``."""
    timed = rounds[warmup:]
    if not timed:
        raise ConfigError(f"no rounds after {warmup} warm-up rounds")
    ops = [op for op in OPS + HOP_OPS if op in timed[0][0]]
    return {op: summarise(max(rank[op] for rank in ranks) for ranks in timed).scaled(1e3) for op in ops}


# -- the ranks ----------------------------------------------------------------------------------------
class CollectiveRank:
    """One rank of the benchmark (a Ray actor): joins the gloo group and times collectives."""

    def __init__(self, *, rank: int, world_size: int, group_name: str, timeout_s: float) -> None:
        torch.set_num_threads(1)  # like every rank of the side-by-side benchmark
        self.rank, self.world_size = rank, world_size
        self._name, self._timeout_s = group_name, timeout_s
        self._group: Any = None
        self._buf: torch.Tensor | None = None

    def join(self) -> None:
        from zero_ray.collective.ray_group import form_group

        self._group = form_group(backend="gloo", group_name=self._name, rank=self.rank, world_size=self.world_size,
                                 timeout_s=self._timeout_s)

    def _all_reduce(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        work = dist.all_reduce(buf, group=self._group.process_group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))

    def _hop(self, parts: tuple[torch.Tensor, ...]) -> None:
        import torch.distributed as dist

        pg, n = self._group.process_group, self.world_size
        works = [dist.isend(parts[0], (self.rank + 1) % n, group=pg), dist.irecv(parts[1], (self.rank - 1) % n, group=pg)]
        for work in works:
            work.wait(timeout=datetime.timedelta(seconds=self._timeout_s))

    def round(self, numel: int, ops: Sequence[str] = OPS) -> dict[str, float]:
        """Run each of ``ops`` once on a ``numel`` float32 buffer; seconds by operation."""
        if self._buf is None or self._buf.numel() != numel:
            self._buf = None
            self._group.release_scratch()
            self._buf = torch.empty(numel, dtype=torch.float32)
        buf, group = self._buf, self._group
        run: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: self._all_reduce(buf),
            "ring_all_reduce": lambda: group.all_reduce_(buf),
            "reduce_scatter": lambda: group.reduce_scatter_(buf),
            "all_gather": lambda: group.all_gather_(buf),
            "hop": lambda: self._hop(buf.chunk(self.world_size)),
            "add": lambda: buf.chunk(self.world_size)[0].add_(buf.chunk(self.world_size)[1]),
        }
        out = {}
        for op in ops:
            buf.fill_(1.0)  # sums stay small however many rounds run
            group.barrier()
            start = time.perf_counter()
            run[op]()
            out[op] = time.perf_counter() - start
        return out

    def close(self) -> None:
        from zero_ray.collective.ray_group import destroy_group

        self._buf = None
        destroy_group(self._name)


def _time_world(world_size: int, config: CollectivesConfig, say: Callable[[str], None]) -> list[CollectiveRow]:
    import ray

    cls = ray.remote(num_cpus=1, max_restarts=0)(CollectiveRank)
    name = f"bench-collectives-{uuid.uuid4().hex[:8]}"
    ranks = [cls.remote(rank=r, world_size=world_size, group_name=name, timeout_s=config.timeout_s)
             for r in range(world_size)]
    rows = []
    try:
        ray.get([a.join.remote() for a in ranks], timeout=config.timeout_s)
        for mib in config.sizes_mib:
            numel = mib * _MIB // _ELEMENT
            ops = OPS + (HOP_OPS if config.hops else ())
            rounds = [ray.get([a.round.remote(numel, ops) for a in ranks], timeout=config.timeout_s)
                      for _ in range(config.warmup + config.rounds)]
            row = CollectiveRow(world_size=world_size, size_bytes=numel * _ELEMENT,
                                times_ms=summarise_rounds(rounds, warmup=config.warmup))
            say(f"[{world_size} ranks] {mib} MiB: " + ", ".join(
                f"{op} {row.times_ms[op].median:.1f} ms" for op in row.times_ms))
            rows.append(row)
    finally:
        try:
            ray.get([a.close.remote() for a in ranks], timeout=10)
        except Exception:  # a rank stuck in a collective cannot close; it is killed next
            log.warning("collective ranks did not close cleanly", exc_info=True)
        for a in ranks:
            ray.kill(a, no_restart=True)
    return rows


def run_collectives(config: CollectivesConfig, *, progress: Callable[[str], None] | None = None) -> CollectivesResults:
    """Time every size at every world size on the connected Ray (a local one is started when
    none is); returns the results."""
    import ray

    from benchmarks.harness.runner import ensure_ray, loadavg, machine_info

    say = progress or (lambda _msg: None)
    ensure_ray(max(config.world_sizes))
    machine = machine_info()
    machine["ray_cluster_cpus"] = ray.cluster_resources().get("CPU")
    rows: list[CollectiveRow] = []
    for n in config.world_sizes:
        rows += _time_world(n, config, say)
    machine["loadavg_end"] = loadavg()
    settings = {"sizes_mib": list(config.sizes_mib), "world_sizes": list(config.world_sizes),
                "rounds": config.rounds, "warmup": config.warmup, "target": config.target, "hops": config.hops,
                "direct_max_bytes": DIRECT_MAX_BYTES, "backend": "gloo",
                "dtype": "float32", "num_cpus_per_rank": 1, "torch_threads_per_rank": 1}
    return CollectivesResults(machine=machine, settings=settings, rows=tuple(rows),
                              notes=tuple(target_notes(rows, config.target)))


# -- command line -----------------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from err


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default = CollectivesConfig()
    parser.add_argument("--sizes-mib", type=_ints, default=default.sizes_mib,
                        help="comma-separated buffer sizes in MiB (default 1,4,16,64,256)")
    parser.add_argument("--world-sizes", type=_ints, default=default.world_sizes, help="default 2,4")
    parser.add_argument("--rounds", type=int, default=default.rounds, help=f"timed rounds (default {default.rounds})")
    parser.add_argument("--warmup", type=int, default=default.warmup, help=f"default {default.warmup}")
    parser.add_argument("--target", type=float, default=default.target, help=f"default {default.target}")
    parser.add_argument("--hops", action="store_true",
                        help="also time one ring hop (1/N exchange) and one add of 1/N: where the time goes")
    parser.add_argument("--timeout", type=float, default=default.timeout_s, help="seconds (default 600)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT, help=f"default {DEFAULT_OUTPUT}")
    parser.add_argument("--render", metavar="JSON", help="re-render an existing results file instead of running")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.render:
            results = read_results(args.render)
        else:
            config = CollectivesConfig(sizes_mib=args.sizes_mib, world_sizes=args.world_sizes, rounds=args.rounds,
                                       warmup=args.warmup, target=args.target, hops=args.hops,
                                       timeout_s=args.timeout)
            progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
            results = run_collectives(config, progress=progress)
    except (ZeroRayError, OSError) as err:
        print(f"collectives benchmark: {err}", file=sys.stderr)
        return 2
    written = write_results(results, args.output_dir)
    print(render_markdown(results))
    print("wrote " + ", ".join(written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
