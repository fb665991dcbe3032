"""Operator commands for a running job, spoken to its driver's Coordinator service:

    zero-ray status          [--ray-address A]                  the detached runs on a Ray cluster
    zero-ray status          --address HOST:PORT --token-file F
    zero-ray checkpoint now  --address HOST:PORT --token-file F [--path P]
    zero-ray stop            --address HOST:PORT --token-file F [--reason R]
    zero-ray resize M        --address HOST:PORT --token-file F

The token file is the one the driver wrote (it holds the job id and the token).
Any failure prints one line on stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping

from zero_ray.cli.subcommand_groups import SubParsers, subcommand_group
from zero_ray.control.auth import read_token_file
from zero_ray.control.client import ClientConfig, CoordinatorClient
from zero_ray.control.handlers import JobStatus, OwnerStatus
from zero_ray.errors import AuthError, ZeroRayError

_DEFAULT_TIMEOUT_S = 10.0
# A checkpoint call returns once every owner has written its shard.
_CHECKPOINT_TIMEOUT_S = 600.0


def _connection_arguments(parser: argparse.ArgumentParser, *, timeout_s: float, required: bool = True) -> None:
    parser.add_argument("--address", required=required, metavar="HOST:PORT", help="the driver's control address")
    parser.add_argument("--token-file", required=required, metavar="FILE", help="the token file the driver wrote")
    parser.add_argument("--timeout", type=float, default=timeout_s, metavar="SECONDS",
                        help=f"deadline of the call (default {timeout_s:g})")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA certificate to verify the driver (turns TLS on)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate, for mTLS")
    parser.add_argument("--tls-key", metavar="FILE", help="client key, for mTLS")
    parser.add_argument("--tls-server-name", metavar="NAME", help="name to expect in the driver's certificate")


def register(subparsers: SubParsers) -> None:
    """Add ``status``, ``checkpoint now``, ``stop`` and ``resize``."""
    status = subparsers.add_parser("status", help="show a running job's step, loss and per-rank health; without "
                                                  "--address, the detached runs whose owners are alive")
    _connection_arguments(status, timeout_s=_DEFAULT_TIMEOUT_S, required=False)
    status.add_argument("--flight", action="store_true",
                        help="also ask every owner where it is now: its phase and the collective it waits in, "
                             "and which rank the others wait for (a stalled step)")
    status.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="the Ray cluster to list detached runs of (default: RAY_ADDRESS, else a running one)")
    status.set_defaults(func=_status, command_name="status")

    checkpoint = subcommand_group(subparsers, "checkpoint", help="write, inspect and convert checkpoints")
    now = checkpoint.add_parser("now", help="have a running job write a checkpoint now")
    _connection_arguments(now, timeout_s=_CHECKPOINT_TIMEOUT_S)
    now.add_argument("--path", default=None, help="where to write it (default: the job's checkpoint directory)")
    now.set_defaults(func=_checkpoint_now, command_name="checkpoint now")

    stop = subparsers.add_parser("stop", help="stop a running job after its current step")
    _connection_arguments(stop, timeout_s=_DEFAULT_TIMEOUT_S)
    stop.add_argument("--reason", default="requested with zero-ray stop", help="recorded in the driver's log")
    stop.set_defaults(func=_stop, command_name="stop")

    resize = subparsers.add_parser("resize", help="continue a running job with M partition owners")
    resize.add_argument("world_size", type=int, metavar="M", help="the new number of partition owners")
    _connection_arguments(resize, timeout_s=_DEFAULT_TIMEOUT_S)
    resize.set_defaults(func=_resize, command_name="resize")


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(err).__name__


def _run(args: argparse.Namespace, action: Callable[[CoordinatorClient], str]) -> int:
    """Connect as the arguments say, run ``action`` and print what it returns;
    domain errors become one line on stderr and exit status 1."""
    try:
        config = ClientConfig(address=args.address, credentials=read_token_file(args.token_file),
                              timeout_s=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, tls_server_name=args.tls_server_name)
        with CoordinatorClient(config) as client:
            output = action(client)
    except AuthError as err:
        print(f"zero-ray {args.command_name}: error: {_one_line(err)} (is {args.token_file} this job's token file?)",
              file=sys.stderr)
        return 1
    except ZeroRayError as err:
        print(f"zero-ray {args.command_name}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    print(output)
    return 0


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024.0 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def _memory(memory: Mapping[str, int]) -> str:
    return " ".join(f"{kind}={_human_bytes(size)}" for kind, size in sorted(memory.items())) or "-"


def format_status(status: JobStatus, now: float | None = None) -> str:
    """The text ``zero-ray status`` prints; ``now`` (Unix time) dates the heartbeats."""
    now = time.time() if now is None else now
    lines = [
        f"state       {status.state}",
        f"world size  {status.world_size}",
        f"stage       {status.stage}",
        f"step        {status.step}",
        f"last loss   {status.last_loss:.6g}",
    ]
    if status.ranks:
        rows = [("rank", "node", "healthy", "state", "heartbeat", "memory")]
        for rank in sorted(status.ranks, key=lambda r: r.rank):
            # Clocks of driver and operator differ a little; never print a negative age.
            age = f"{max(0.0, now - rank.last_heartbeat):.1f}s ago" if rank.last_heartbeat > 0 else "never"
            rows.append((str(rank.rank), rank.node or "-", "yes" if rank.healthy else "NO", rank.state or "-", age,
                         _memory(rank.memory)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines.append("")
        lines.extend("  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths)), row[-1]]) for row in rows)
    if status.events:
        lines += ["", "events", *(f"  {e}" for e in status.events)]
    if status.flight:
        lines += ["", "where every owner is (flight records)", *(f"  {line}" for line in status.flight)]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    if args.address is None and args.token_file is None:
        return _detached(args)
    if args.address is None or args.token_file is None:
        print("zero-ray status: error: give both --address and --token-file (a job's driver), or neither (the "
              "detached runs on the Ray cluster)", file=sys.stderr)
        return 2
    return _run(args, lambda client: format_status(client.status(flight=args.flight)))


def format_detached(runs: Mapping[str, list[OwnerStatus]]) -> str:
    """The text ``zero-ray status`` prints for the detached runs (``driver.attach.detached_runs``)."""
    if not runs:
        return "no detached runs"
    rows = [("run id", "owners", "steps done", "generation", "state", "nodes")]
    for run, owners in sorted(runs.items()):
        steps = sorted({o.step for o in owners})
        phases = sorted({o.phase for o in owners})
        rows.append((run, str(len(owners)), "/".join(map(str, steps)), str(max(o.generation for o in owners)),
                     ",".join(phases), ",".join(sorted({o.ip for o in owners}))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["detached runs (attach with ZeroTrainer.attach(run_id, model_fn, loss_fn))", ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _detached(args: argparse.Namespace) -> int:
    import ray

    from zero_ray.driver.attach import detached_runs

    try:
        if not ray.is_initialized():
            ray.init(address=args.ray_address or "auto", log_to_driver=False, logging_level="ERROR")
        runs = detached_runs(timeout_s=args.timeout)
    except (ConnectionError, RuntimeError, ZeroRayError) as err:
        print(f"zero-ray status: error: {_one_line(err)} (is a Ray cluster running? pass --ray-address or "
              "RAY_ADDRESS)", file=sys.stderr)
        return 1
    print(format_detached(runs))
    return 0


def _checkpoint_now(args: argparse.Namespace) -> int:
    def action(client: CoordinatorClient) -> str:
        result = client.checkpoint(args.path)
        return f"checkpoint of step {result.step} written to {result.path}"

    return _run(args, action)


def _stop(args: argparse.Namespace) -> int:
    return _run(args, lambda client: f"stop requested; the job is {client.stop(args.reason)}")


def _resize(args: argparse.Namespace) -> int:
    def action(client: CoordinatorClient) -> str:
        result = client.resize(args.world_size)
        return f"resize requested: {result.previous_world_size} -> {result.world_size} partition owners"

    return _run(args, action)
