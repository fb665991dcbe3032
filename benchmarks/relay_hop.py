"""What one relay hop costs (issue 44): 8 simulated owners under one real relay.

    python -m benchmarks.relay_hop [--calls 200] [--owners 8] [--json OUT]

Three processes on this machine: the owners (``benchmarks/control_sim.py``: the real owner
control server over a stand-in engine answering at once), the relay (a ``RelayHop`` served on
a ``ControlServer``, its ``OwnerClient`` children carrying the run's token) and this one, the
caller. Per call it times, interleaved so that load on the machine falls on both alike:

- ``direct``: the caller's own fan-out to every owner (``step_async`` to each, all awaited),
  what the hop itself does for its children;
- ``relayed``: one ``RelayStep`` to the relay, which does that fan-out and combines the replies.

The hop's added latency is the median ``relayed`` minus the median ``direct``: one more gRPC
round trip, the request and reply conversions and the combining. The hop's CPU per RelayStep
is the relay process's CPU (getrusage) over the interleaved calls, less what it burnt idle over
as many direct-only calls, divided by the calls. Composing the end-to-end figure: driver +
depth x (hop's added latency) + the owners' own step. On a loaded 2-core machine the owners,
the relay and the caller compete for the cores: the figures are upper bounds.

Measured on this 2-core machine at load 2.9-4.4 (``--owners 8 --calls 200``): with gRPC's
blocking futures (a thread started per child per step) the hop cost 4.7-5.6 ms of CPU per
RelayStep and added 1.5-1.9 ms (two runs); on one ``grpc.aio`` loop thread
(control/hop_calls.py) 3.2-3.7 ms and -0.4-1.2 ms (four runs). Of about 3.3 ms, about 1.9 ms
are the hop's calls (0.24 ms a child: the aio call, its conversions and the combining) and the
rest the relay's own server: the RelayStep's receipt, its conversions and its reply. ``direct`` still uses the blocking futures
(as the driver's FanOut does), which is why the hop's added latency can come out below zero.
"""

from __future__ import annotations

import argparse
import json
import resource
import secrets
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.control_sim import DATASET, SimSettings, worker_main
from benchmarks.harness.worker_fleet import helper_context
from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, OwnerClient, RelayClient
from zero_ray.control.handlers import Piece, RelayStepArgs, StepArgs
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.relay_hop import OwnerChild, RelayHop
from zero_ray.control.server import ControlServer, ServerConfig

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0
WARMUP = 20


def _recv(conn: Any, what: str) -> Any:
    if not conn.poll(START_TIMEOUT_S):
        raise TimeoutError(f"a benchmark process did not answer {what!r} within {START_TIMEOUT_S:g}s")
    return conn.recv()


def relay_main(conn: Any, addresses: list[str], job_id: str, token: str) -> None:
    """The relay's process: a hop over ``addresses`` (rank r at ``addresses[r]``, all on one
    node), served until "stop"; "cpu" answers its CPU seconds so far."""
    credentials = Credentials(job_id=job_id, token=token)
    clients = [OwnerClient(ClientConfig(address=a, credentials=credentials, timeout_s=CALL_TIMEOUT_S))
               for a in addresses]
    hop = RelayHop(host=0, children=[OwnerChild(rank=r, node="sim", client=c) for r, c in enumerate(clients)])
    server = ControlServer(ServerConfig(host="127.0.0.1", credentials=credentials, threads=16))
    server.add_relay(RelayHost.serving({0: hop}, rank=0, template=clients[0].config))
    conn.send(server.start())
    while True:
        command = conn.recv()
        if command == "cpu":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            conn.send(ru.ru_utime + ru.ru_stime)
        elif command == "stop":
            server.stop(0.0)
            hop.close()
            for c in clients:
                c.close()
            conn.send(True)
            return


def _args(step: int, owners: int) -> list[StepArgs]:
    return [StepArgs(step=step, piece=Piece(dataset=DATASET, indices=(r,)), global_samples=owners, generation=0,
                     samples_seen=step * owners) for r in range(owners)]


def measure(owners: int = 8, calls: int = 200) -> dict[str, float]:
    """The hop's added latency (median) and CPU per RelayStep over ``calls`` calls."""
    credentials = Credentials(job_id="relay-hop-bench", token=secrets.token_urlsafe(32))
    ctx = helper_context()
    owners_conn, child = ctx.Pipe()
    owners_proc = ctx.Process(target=worker_main, args=(child, list(range(owners)), SimSettings(
        world_size=owners, job_id=credentials.job_id, token=credentials.token, compute_s=0.0, timestamps=False)),
        daemon=True)
    owners_proc.start()
    addresses = _recv(owners_conn, "addresses")
    relay_conn, child = ctx.Pipe()
    relay_proc = ctx.Process(target=relay_main, args=(child, addresses, credentials.job_id, credentials.token),
                             daemon=True)
    relay_proc.start()
    relay = RelayClient(ClientConfig(address=_recv(relay_conn, "address"), credentials=credentials,
                                     timeout_s=CALL_TIMEOUT_S))
    direct = [OwnerClient(ClientConfig(address=a, credentials=credentials, timeout_s=CALL_TIMEOUT_S))
              for a in addresses]
    step = 0

    def fan_out() -> float:
        nonlocal step
        began = time.perf_counter()
        pending = [c.step_async(a) for c, a in zip(direct, _args(step, owners))]
        for p in pending:
            p.result()
        step += 1
        return time.perf_counter() - began

    def relayed() -> float:
        nonlocal step
        common = StepArgs(step=step, piece=Piece(dataset=DATASET), global_samples=owners, generation=0,
                          samples_seen=step * owners)
        args = RelayStepArgs.of(common, ranks=range(owners), counts=[1] * owners, indices=range(owners),
                                timeout_s=CALL_TIMEOUT_S)
        began = time.perf_counter()
        reply = relay.relay_step(args, timeout_s=CALL_TIMEOUT_S + 5)
        took = time.perf_counter() - began
        if reply.failure is not None or not reply.ranks.covers(owners):
            raise RuntimeError(f"the relayed step failed: {reply.failure}")
        step += 1
        return took

    def relay_cpu() -> float:
        relay_conn.send("cpu")
        return _recv(relay_conn, "cpu")

    try:
        for _ in range(WARMUP):
            fan_out(), relayed()
        c0 = relay_cpu()
        for _ in range(calls):
            fan_out()
        idle = relay_cpu() - c0
        c1 = relay_cpu()
        timed = [(fan_out(), relayed()) for _ in range(calls)]
        busy = relay_cpu() - c1
    finally:
        relay_conn.send("stop")
        owners_conn.send("stop")
        _recv(relay_conn, "stop"), _recv(owners_conn, "stop")
        relay.close()
        for c in direct:
            c.close()
        relay_proc.join(10.0)
        owners_proc.join(10.0)
    direct_ms = statistics.median(d for d, _ in timed) * 1e3
    relayed_ms = statistics.median(r for _, r in timed) * 1e3
    return {"owners": owners, "calls": calls, "direct_fan_out_ms": direct_ms, "relayed_ms": relayed_ms,
            "hop_added_ms": relayed_ms - direct_ms, "hop_cpu_ms_per_relay_step": (busy - idle) / calls * 1e3,
            "hop_idle_cpu_ms_per_call": idle / calls * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_hop", description=__doc__.split("\n")[0])
    parser.add_argument("--owners", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    row = measure(args.owners, args.calls)
    for key, value in row.items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(row, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
