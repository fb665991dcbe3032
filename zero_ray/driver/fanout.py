"""FanOut: one call on every owner at once, through Ray or the gRPC control plane.

Every wait is bounded. While waiting, the health monitor is watched: when it reports an owner
lost, the survivors' collectives of the current generation are aborted at once (so that none
of them waits out ``collective_timeout_s`` on the dead one, whatever the operation: a step, a
resize transfer, a rebuild, a peer snapshot) and ``OwnerLostError`` is raised. The first
failure of any owner is raised at once too: the others may be blocked on the failed one.

Remote failures come back as domain errors: a Ray task error as the cause's own type
(ConfigError, ModelError, ...) or an OwnerError, always with the remote traceback; a gRPC status
as the type its message names; a dead actor as OwnerLostError naming its rank and node.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import grpc
import ray

from zero_ray import errors
from zero_ray.control.client import OwnerClient
from zero_ray.errors import ControlError, OwnerError, OwnerLostError, ZeroRayError, domain_error

T = TypeVar("T")
POLL_S = 0.2  # how often a wait looks at the health monitor


def remote_error(err: Exception, where: str, rank: int, method: str) -> ZeroRayError:
    """A Ray failure of ``method`` on the owner ``where`` describes, as a domain error."""
    if isinstance(err, ray.exceptions.RayActorError):
        return OwnerLostError(f"partition owner {where} died during {method}: {err}", rank=rank)
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause
        tb = str(err)
        return domain_error(type(cause), f"{where} failed in {method}: {cause}\n\nRemote traceback:\n{tb}", rank=rank,
                            fallback=f"{where} failed in {method}: {cause!r}", remote_traceback=tb)
    return OwnerError(f"{where} failed in {method}: {err!r}", rank=rank)


def control_error(err: ControlError, where: str, rank: int, what: str) -> ZeroRayError:
    """The owner's domain error rebuilt from its gRPC status ("Method: TypeName: message")."""
    cause = err.__cause__
    details = cause.details() if isinstance(cause, grpc.Call) else ""
    match = re.match(r"^[\w.]+: (\w+): (.*)$", details or "", flags=re.S)
    if match:
        return domain_error(getattr(errors, match.group(1), None), f"{where} failed in {what}: {match.group(2)}",
                            rank=rank)
    return OwnerError(f"{where} failed in {what}: {err}", rank=rank)


class FanOut:
    """Bounded calls on every owner of a pool."""

    def __init__(self, *, workers: int, lost: Callable[[], dict[int, str]], abort: Callable[[str], None],
                 where: Callable[[int], str]) -> None:
        # Steps may block for their whole deadline; aborts and stats must never queue behind them.
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zero_ray-rpc")
        self._lost = lost
        self._abort = abort
        self._where = where

    def check(self, what: str) -> None:
        """Raise (after aborting the survivors) when the health monitor has lost an owner."""
        lost = self._lost()
        if lost:
            rank = min(lost)
            reason = f"partition owner {self._where(rank)} stopped answering during {what}: {lost[rank]}"
            self._abort(reason)
            raise OwnerLostError(reason, rank=rank)

    def ray(self, actors: Sequence[Any], method: str, *args: Any, timeout_s: float,
            per_rank: Sequence[tuple[Any, ...]] | None = None, kwargs: Sequence[dict[str, Any]] | None = None,
            watch: bool = True, ranks: Sequence[int] | None = None) -> list[Any]:
        """``actors[i].method(...)`` for every i through Ray; results in order. ``ranks`` names
        the actors in errors (default: their positions)."""
        names = list(ranks) if ranks is not None else list(range(len(actors)))
        refs = [getattr(a, method).remote(*(per_rank[i] if per_rank else args), **(kwargs[i] if kwargs else {}))
                for i, a in enumerate(actors)]
        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(names[index[r]] for r in pending)
                raise OwnerLostError(f"ranks {late} did not finish {method} within {timeout_s:g}s", rank=late[0])
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, POLL_S))
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except Exception as err:
                    raise remote_error(err, self._where(names[i]), names[i], method) from err
            if watch:
                self.check(method)
        return [results[i] for i in range(len(refs))]

    def grpc(self, clients: Sequence[OwnerClient], what: str, call: Callable[[OwnerClient, int], T], *,
             watch: bool = True) -> list[T]:
        """``call(client, rank)`` for every owner over the control plane; results in rank order."""
        futures = {self.executor.submit(call, c, r): r for r, c in enumerate(clients)}
        results: dict[int, T] = {}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            for fut in done:
                rank = futures[fut]
                try:
                    results[rank] = fut.result()
                except ControlError as err:
                    raise control_error(err, self._where(rank), rank, what) from err
            if watch:
                self.check(what)
        return [results[r] for r in range(len(futures))]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
