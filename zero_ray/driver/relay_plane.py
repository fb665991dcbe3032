"""RelayPlane: a pool's steps and evaluations sent down the relay tree (issue 44) instead of to
every owner.

The tree is planned from the owners' nodes alone (``core/relay_tree.py``: a relay per node,
relays above them while there are more than ``fan_out``, each on the lowest rank under it) and
hosted in the owners' own processes (``control/relay_host.py``): after every membership change
the pool calls :meth:`RelayPlane.replan`, which tells each process what it serves
(``HostRelays``, one call per hosting rank, the processes that hosted before and no longer do
told to serve none) and builds the driver's own hop over the top relays. A step is then one
call per top relay, made on the hop's loop thread; the reply is every owner's combined on the
way up, so the driver's work per step grows with the top relays, not the owners.

The driver keeps watching each owner's health as before (the monitor wakes the fan-out's
wait the moment it loses a rank): a loss fails the step at once, whether the tree has
answered or not, and the survivors are aborted down the tree (:meth:`RelayPlane.abort`: one
call per live subtree, routed around a lost rank's relays, whose own children are called
directly). A rank's failure inside the tree comes back as the
reply's ``failure`` and is raised here as its own domain error, named by its rank and node;
a relay that died is its host rank's OwnerLostError, so every recovery path is the one a
direct fan-out takes, and the recovery's membership change re-plans the tree.

Which path a pool takes is ``RelayConfig.min_owners`` (``ZeroConfig(relays=...)``): below it
one hop costs more than calling the owners directly (``python -m benchmarks.control_scale``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Callable, Collection
from typing import Any, cast

from zero_ray.control.client import ClientConfig, RelayClient
from zero_ray.control.client_channel import Pending
from zero_ray.control.handlers import HostRelaysArgs
from zero_ray.control.heap_freeze import freeze_heap
from zero_ray.control.relay_hop import DEFAULT_MARGIN_S, HopChild, RelayHop, close_relays, hop_children
from zero_ray.control.client_channel import header_of
from zero_ray.control.handlers import OwnerStats
from zero_ray.control.relay_calls import abort_args, forwarded_args, forwarded_results
from zero_ray.control.relay_host import host_plans
from zero_ray.core.relay_tree import RelayConfig, RelayTree, plan_relays
from zero_ray.core.reply_combine import CombinedEvaluation, CombinedStep, RankFailure, RankSpans
from zero_ray.driver.batch_staging import EvaluateCommand, StepCommand
from zero_ray.driver.fanout import POLL_S, FanOut, InFlight, Members
from zero_ray.errors import RelayError

log = logging.getLogger(__name__)

RelayFlight = InFlight[CombinedStep]


class RelayPlane:
    """The relay tree over a pool's members, and the driver's hop over its top relays. Its
    clients are configured as the pool's own (``client_config``: ``PoolSpec.client_config``), so
    every hop carries the run's token and TLS."""

    _config: RelayConfig
    _members: Members
    _fan: FanOut
    _client_config: Callable[[str], ClientConfig]  # by the control address it reaches
    _margin_s: float
    tree: RelayTree | None
    _top: RelayHop | None
    _hosts: dict[int, RelayClient]  # by rank: the Relay service of each process hosting relays
    _executor: ThreadPoolExecutor

    def __init__(self, *, config: RelayConfig, members: Members, fan: FanOut,
                 client_config: Callable[[str], ClientConfig], margin_s: float = DEFAULT_MARGIN_S) -> None:
        self._config = config
        self._members = members
        self._fan = fan
        self._client_config = client_config
        self._margin_s = margin_s
        self.tree = None
        self._top = None
        self._hosts = {}
        # A step and the one sent ahead of it wait here, each in one blocking call on the hop.
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zero_ray-relay-plane")

    @property
    def top_children(self) -> tuple[HopChild, ...]:
        """The relays the driver calls (and watches: ``SubtreeHealthMonitor``); none off the tree."""
        return self._top.children if self._top is not None else ()

    @property
    def active(self) -> bool:
        """Whether steps take the tree: the pool is at least ``min_owners`` strong."""
        return self.tree is not None

    def replan(self) -> None:
        """Plan the tree over the members of now and have every process serve its part (or, below
        ``min_owners``, serve none: steps go to the owners directly)."""
        members = self._members
        world = len(members.clients)
        tree = plan_relays([n["node_id"] for n in members.nodes], self._config) \
            if world >= self._config.min_owners else None
        addresses = {r: n["control_address"] for r, n in enumerate(members.nodes)}
        plans = host_plans(tree, addresses, margin_s=self._margin_s) if tree is not None else {}
        # A process that hosted before and still is a member (by its address: a rebuild renumbers
        # the survivors) serves none now, unless planned again; its client is kept.
        old = {c.config.address: c for c in self._hosts.values()}
        rank_at = {a: r for r, a in addresses.items()}
        told = {r: plans.get(r, HostRelaysArgs()) for r in sorted({*plans, *(rank_at[a] for a in old if a in rank_at)})}
        hosts = {r: old.pop(addresses[r], None) or RelayClient(self._client_config(addresses[r])) for r in told}
        old_top = self._top
        self.tree, self._top, self._hosts = None, None, {}
        self._members.relays = None
        close_relays([old_top] if old_top is not None else [], old.values())  # the clients of processes no longer members
        try:
            ranks = list(told)
            self._fan.grpc([hosts[r] for r in ranks], "host_relays", lambda c, i: c.host_relays(told[ranks[i]]),
                           watch=False, ranks=ranks)
        except BaseException:
            close_relays([], hosts.values())
            raise
        self._hosts = {r: c for r, c in hosts.items() if told[r].relays}
        close_relays([], [c for r, c in hosts.items() if not told[r].relays])
        if tree is not None:
            freeze_heap()  # a full collection of the driver's heap would hold a step's dispatch
            tops = {c.id: self._hosts[c.host] for c in tree.driver_children}
            self._top = RelayHop(host=None, children=hop_children(tree, None, owners={}, relays=tops),
                                 margin_s=self._margin_s)
            self.tree = tree
            self._members.relays = self  # the survivors' abort takes the tree too (FanOut.abort)
            log.info("relay tree over %d owners on %d nodes: %d relays, depth %d, %d top relays", world,
                     len(set(tree.nodes)), len(tree.relays), tree.depth, len(tree.driver_children))

    def start_step(self, command: StepCommand, *, timeout_s: float, staged: dict[int, Any]) -> RelayFlight:
        """Send a step down the tree and return at once (``collect`` waits for it). The request is
        what every rank runs and the dataset's indices packed (``StepCommand.relayed``): 0.17 ms
        of the driver's CPU at 1,024 owners and 1.1 ms at 8,192, where a request per owner costs
        11 and 91 ms (``python -m benchmarks.step_request``)."""
        top = self._top
        if top is None:
            raise RelayError("the relay tree is not planned: the pool steps its owners directly below "
                             f"RelayConfig.min_owners={self._config.min_owners}")
        relayed = command.relayed(timeout_s=timeout_s)
        return FanOut.start([top], "step", lambda hop, _: cast(Pending[CombinedStep], self._executor.submit(
            hop.relay_step, relayed)), staged=staged)

    def collect(self, flight: RelayFlight) -> CombinedStep:
        """The combined reply of the step ``flight`` sent; a rank's failure raised as its error."""
        reply = self._fan.collect(flight)[0]
        self._check(reply.failure, reply.ranks)
        return reply

    def evaluate(self, command: EvaluateCommand, *, timeout_s: float, staged: dict[int, Any]) -> CombinedEvaluation:
        """An evaluation down the tree, packed as a step is (``EvaluateCommand.relayed``), every
        owner's loss totals combined on the way up; waited for as a step is (the health monitor
        and the staging calls looked at meanwhile), a rank's failure raised as its error."""
        top = self._top
        if top is None:
            raise RelayError("the relay tree is not planned: the pool evaluates on its owners directly below "
                             f"RelayConfig.min_owners={self._config.min_owners}")
        relayed = command.relayed(timeout_s=timeout_s)
        flight = FanOut.start([top], "evaluate", lambda hop, _: cast(
            Pending[CombinedEvaluation], self._executor.submit(hop.relay_evaluate, relayed)), staged=staged)
        reply = self._fan.collect(flight)[0]
        self._check(reply.failure, reply.ranks)
        return reply

    def stats(self, *, timeout_s: float) -> list[OwnerStats]:
        """Every owner's counters (``Stats``, for ``memory_report`` / ``comm_report``), in rank
        order, through the tree as one forwarded call (``Relay.RelayCall``): the driver sends one
        request per top relay and reads one reply from each, every rank's reply inside unparsed
        until here. A rank that did not answer raises its error, as the direct path does."""
        top = self._top
        if top is None:
            raise RelayError("the relay tree is not planned: the pool asks its owners directly below "
                             f"RelayConfig.min_owners={self._config.min_owners}")
        world = len(self._members.clients)
        header = header_of(self._client_config(self._members.nodes[0]["control_address"]))
        reply = top.relay_call(forwarded_args("Stats", header, ranks=range(world), timeout_s=timeout_s))
        self._check(reply.failure, reply.ranks)
        return forwarded_results("Stats", reply)

    def _check(self, failure: RankFailure | None, ranks: RankSpans) -> None:
        """Raise a rank's failure as its own domain error (named by its rank and node, as the
        direct fan-out names it), or RelayError for a reply that is not the whole pool's."""
        if failure is not None:
            where = self._members.where(failure.rank)
            raise failure.detail.error(where, rank=failure.rank)
        world = len(self._members.clients)
        if not ranks.covers(world):
            raise RelayError(f"the relay tree's reply covers ranks {ranks.spans}, not the pool's 0-{world - 1}: "
                             "the tree was planned over another membership")

    def abort(self, reason: str, generation: int, *, gone: Callable[[], Collection[int]],
              timeout_s: float) -> set[int]:
        """Abort ``generation``'s collectives down the tree (``Relay.RelayCall`` of ``Abort``):
        one call per subtree holding no rank of ``gone()`` (``RelayTree.around``: none passes
        through a relay in a lost rank's process, so a lost relay host does not cut its subtree
        off), each on the relay's own host, all at once. Returns the ranks that took it; the
        caller (``FanOut.abort``) calls the others directly: the ranks a lost rank's relays
        called themselves, and those of a subtree that failed. A subtree call is given up (its
        ranks left to the caller) once one of its ranks is lost meanwhile, as a direct abort
        stops waiting for a lost rank; the rest are bounded by ``timeout_s`` and the margin."""
        tree, hosts = self.tree, dict(self._hosts)
        if tree is None or not self._members.nodes:
            return set()
        relays, _ = tree.around(set(gone()))
        header = header_of(self._client_config(self._members.nodes[0]["control_address"]))
        calls: dict[Future[Any], tuple[int, ...]] = {}
        executor = ThreadPoolExecutor(max_workers=max(1, len(relays)), thread_name_prefix="zero_ray-relay-abort")
        try:
            for relay in relays:
                client = hosts.get(relay.host)
                if client is None:  # not hosted (a replan under way): its ranks are called directly
                    continue
                ranks = tree.ranks_under(relay.id)
                args = abort_args(header, reason=reason, generation=generation, ranks=ranks, timeout_s=timeout_s,
                                  relay=relay.id)
                calls[executor.submit(client.relay_call, args, timeout_s=timeout_s + self._margin_s)] = ranks
            deadline = time.monotonic() + timeout_s + 2 * self._margin_s
            pending = set(calls)
            while pending and time.monotonic() < deadline:
                _, pending = wait(pending, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())),
                                  return_when=FIRST_COMPLETED)
                lost = set(gone())
                pending = {f for f in pending if lost.isdisjoint(calls[f])}
        finally:
            executor.shutdown(wait=False)
        answered: set[int] = set()
        for future in calls:
            if future.done() and future.exception() is None:
                answered.update(o.rank for o in future.result().replies if o.failure is None)
            elif future.done():
                log.debug("the abort of ranks %d-%d through the tree failed: %s", calls[future][0],
                          calls[future][-1], future.exception())
        return answered

    def close(self) -> None:
        top, hosts = self._top, list(self._hosts.values())
        self.tree, self._top, self._hosts = None, None, {}
        self._members.relays = None
        close_relays([top] if top is not None else [], hosts)
        self._executor.shutdown(wait=False, cancel_futures=True)

