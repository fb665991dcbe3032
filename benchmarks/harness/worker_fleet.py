"""The helper processes of a control benchmark, each spoken to over its own pipe: the simulated
owners' workers (``control_measure.SimCluster``) and the stand-in run's relays and subtrees
(``control_standin.StandInCluster``) answer the same commands, so they share this shell."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

# What every helper process runs, imported once by the fork server: each spawned helper imported
# zero_ray (torch, Ray) itself, 1.6 CPU-s apiece, the stand-in's four one after another. (relay_hop's
# and relay_health's helpers start here too; their own modules import in milliseconds after these.)
HELPER_MODULES = ["benchmarks.control_sim", "benchmarks.control_standin"]


def helper_context() -> Any:
    """The multiprocessing context helpers start in: children forked from a fork server that has
    imported :data:`HELPER_MODULES` and started no thread (the benchmark's own process has gRPC
    threads, which a fork must never copy, hence no plain fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(HELPER_MODULES)
    return ctx


def recv(conn: Any, timeout_s: float, what: str) -> Any:
    """The next reply on ``conn``; TimeoutError naming the command when none comes in time."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a benchmark worker process did not answer {what!r} within {timeout_s:g}s")
    return conn.recv()


class WorkerFleet:
    """Worker processes and their pipes, the victim (whose SIGKILL the benchmark measures) last."""

    conns: list[Any]
    procs: list[Any]

    @property
    def victim(self) -> Any:
        return self.procs[-1]

    def ask(self, command: str, *, survivors_only: bool = False) -> list[Any]:
        conns = self.conns[:-1] if survivors_only else self.conns
        for conn in conns:
            conn.send(command)
        return [recv(conn, 60.0, command) for conn in conns]

    def usage(self) -> dict[str, float]:
        """Touches, steps and CPU seconds summed over the live workers; the widest beat gap."""
        got = self.ask("usage", survivors_only=not self.victim.is_alive())
        out = {k: sum(u[k] for u in got) for k in ("touches", "steps", "cpu_s")}
        out["max_beat_gap"] = max(u["max_beat_gap"] for u in got)
        return out

    def stop(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send("stop")
                    recv(conn, 30.0, "stop")
                except (OSError, EOFError, TimeoutError):
                    pass
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()  # only our own worker, by its handle
                proc.join(timeout=5.0)
