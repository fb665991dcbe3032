"""One hop of the relay tree (issue 44): the handler of the ``Relay`` service (relay.proto).

A :class:`RelayHop` is built with its children: the owners it calls (:class:`OwnerChild`, a
typed ``OwnerClient`` each) or the relays below it (:class:`RelayChild`, a ``RelayClient``
each), all carrying the run's credentials, so every hop passes the same token and TLS checks as
a call from the driver. For a step it sends each child its ranks' ``StepArgs`` at once, waits at
most the seconds the request carries, and combines the replies with
:mod:`zero_ray.core.reply_combine`. The calls go out on one asyncio loop thread the hop owns
(:mod:`zero_ray.control.hop_calls`: a ``grpc.aio`` channel per child, opened with its client's
configuration): gRPC's blocking futures started a thread per child per step, 0.6 ms of CPU a
child (``python -m benchmarks.relay_hop``). A child that fails, is unreachable or is still
silent when the time is up becomes the combined reply's failure for its ranks, named by its
rank (a relay's: the rank whose process runs it) and node; the other children's results are
kept. The hop itself raises only when the request is not its subtree's (RelayError) or the
children's replies contradict each other (ReplyMismatchError).

Deadlines go down the tree shrinking by ``margin_s`` a hop: a relay below gets the time left
less the margin, so that its reply (with its own late children named) arrives before this hop
gives up on it. An owner gets the time left.

The hop holds no model state, and owns neither its clients (whoever built them closes them; the
hop reads their configuration only) nor the tree: after a loss a new hop is built from the
re-parented ``RelayTree`` (:func:`hop_children`) and the old one closed. :meth:`RelayHop.close`
cancels its calls in flight and ends its thread; a hop dropped unclosed is closed when it is
collected, or at the interpreter's exit.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import grpc

from zero_ray.control.client import OwnerClient, RelayClient
from zero_ray.control.client_channel import convert_error, header_of
from zero_ray.control.handlers import FailureContext, RelayCallArgs, RelayEvaluateArgs, RelayStepArgs
from zero_ray.control.hop_calls import CallOutcome, CallTarget, HopCalls, UnaryRequest
from zero_ray.control.relay_calls import EVALUATE, FORWARDED, STEP, Args, C, RelayedCall, RequestCut
from zero_ray.core.relay_tree import RelayTree
from zero_ray.core.reply_combine import CombinedEvaluation, CombinedReplies, CombinedStep, RankFailure, RankSpans
from zero_ray.errors import (
    CallTimeout,
    ConfigError,
    ControlError,
    FailureDetail,
    OwnerLostError,
    RelayError,
    RemoteFailure,
    ZeroRayError,
)

__all__ = ["DEFAULT_MARGIN_S", "HopChild", "OwnerChild", "RelayChild", "RelayHop", "hop_children"]

# What a relay below is given less than this hop has: its reply's way back, and its own combining.
# A hop's work is milliseconds (benchmarks/relay_hop.py); half a second leaves room for a loaded
# node without eating into a step_timeout_s of minutes.
DEFAULT_MARGIN_S = 0.5


@dataclass(frozen=True, kw_only=True)
class OwnerChild:
    """An owner a hop calls: its rank, its node, and a client of its ``PartitionOwner`` service."""

    rank: int
    node: str
    client: OwnerClient

    def __post_init__(self) -> None:
        if self.rank < 0 or not self.node:
            raise ConfigError(f"OwnerChild(rank={self.rank}, node={self.node!r}) needs a rank >= 0 and its node id")

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    @property
    def host(self) -> int:
        """The rank named when the call fails: the owner's own."""
        return self.rank

    @cached_property
    def spans(self) -> RankSpans:
        return RankSpans.of(self.rank)

    def target(self) -> CallTarget:
        """Where the hop calls the owner: its client's configuration."""
        return CallTarget(config=self.client.config)

    def request(self, call: RelayedCall[Any], cut: RequestCut, time_left_s: float, margin_s: float) -> UnaryRequest:
        """The owner's own request; its deadline is the time the hop has left."""
        method, message = cut.owner_request(self.rank, header_of(self.client.config))
        return UnaryRequest(method=method, message=message, timeout_s=time_left_s)

    def reply(self, call: RelayedCall[C], message: Any) -> C:
        """The owner's reply as a combined one, once it is checked to be this rank's."""
        return call.of_owner(message, self.rank, self.client.address)


@dataclass(frozen=True, kw_only=True)
class RelayChild:
    """A relay a hop calls: its id in the tree (``relay``: which of the relays its process
    serves), the ranks under it, the rank whose process runs it (``host``, named when it
    fails), that rank's node, and a client of its ``Relay`` service."""

    relay: int
    ranks: tuple[int, ...]
    host: int
    node: str
    client: RelayClient

    def __post_init__(self) -> None:
        if not self.ranks or list(self.ranks) != sorted(set(self.ranks)) or self.ranks[0] < 0:
            raise ConfigError(f"RelayChild(ranks={self.ranks}) needs the ranks under the relay, ascending, once each")
        if self.host not in self.ranks or not self.node:
            raise ConfigError(f"RelayChild(host={self.host}, node={self.node!r}): the host is one of the ranks "
                              f"under the relay ({self.ranks[0]}-{self.ranks[-1]}), on that node")

    @cached_property
    def spans(self) -> RankSpans:
        return RankSpans.of_ranks(self.ranks)

    def target(self) -> CallTarget:
        """Where the hop calls the relay: its client's configuration."""
        return CallTarget(config=self.client.config)

    def request(self, call: RelayedCall[Any], cut: RequestCut, time_left_s: float, margin_s: float) -> UnaryRequest:
        """The relay's request for its ranks: it has the time left less ``margin_s`` to answer
        in, and the call the time left."""
        below = time_left_s - margin_s
        if below <= 0:
            raise ControlError(f"{call.relay_method.name} to {self.client.address} was not sent: {time_left_s:.3f}s "
                               f"were left, no more than the hop's margin of {margin_s:g}s; give the call more time",
                               code="DEADLINE_EXCEEDED")
        message = cut.relay_request(self.spans.spans, timeout_s=below, relay=self.relay,
                                    header=header_of(self.client.config))
        return UnaryRequest(method=call.relay_method, message=message, timeout_s=time_left_s)

    def reply(self, call: RelayedCall[C], message: Any) -> C:
        """The relay's reply, once it is checked to cover exactly its ranks."""
        result = call.of_relay(message)
        if result.ranks != self.spans:
            raise RelayError(f"the relay at {self.client.address} answered for ranks {result.ranks.spans}, not the "
                             f"ranks under it {self.spans.spans}: it was built from another tree; rebuild both from "
                             "the same RelayTree")
        return result


HopChild = OwnerChild | RelayChild


def _detail(err: ZeroRayError, child: HopChild, operation: str) -> FailureDetail:
    """Why ``child``'s call failed, as its failure carries it. A handler's failure keeps its
    own detail; a transport failure is named as the driver's fan-out names it (CallTimeout past
    the deadline, OwnerLostError when unreachable)."""
    if isinstance(err, RemoteFailure):
        d = err.detail
        return d if d.rank is not None else dataclasses.replace(d, rank=child.host)
    code = err.code if isinstance(err, ControlError) else ""
    kind = (CallTimeout.__name__ if code == "DEADLINE_EXCEEDED" else OwnerLostError.__name__ if code == "UNAVAILABLE"
            else type(err).__name__)
    return FailureDetail(type=kind, message=str(err), rank=child.host, operation=operation)


def _failed(call: RelayedCall[C], child: HopChild, detail: FailureDetail) -> C:
    return call.failed(child.spans, RankFailure(rank=child.host, node=child.node, detail=detail, at=time.time()))


class RelayHop:
    """One relay's handler: a step (or an evaluation: ``relay_calls``) sent on to its children in
    parallel, their replies combined.
    ``host``: the rank whose process serves it (its failures' rank; None for the driver's own
    hop over the top relays, which is called in process, not served). :meth:`close` ends its
    calls' thread (started by the first step)."""

    _host: int | None
    _children: tuple[HopChild, ...]
    _ranks: tuple[int, ...]
    _spans: RankSpans
    _margin_s: float
    _calls: HopCalls
    _finalizer: weakref.finalize

    def __init__(self, *, host: int | None, children: Sequence[HopChild], margin_s: float = DEFAULT_MARGIN_S) -> None:
        if not children:
            raise ConfigError("a relay hop needs at least one child; build its children with hop_children")
        ranks = sorted(r for c in children for r in c.ranks)
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"the hop's children share ranks ({ranks}): each rank is under exactly one child")
        if not (math.isfinite(margin_s) and margin_s >= 0):
            raise ConfigError(f"margin_s={margin_s} must be a finite number of seconds >= 0")
        self._host = host
        self._children = tuple(children)
        self._ranks = tuple(ranks)
        self._spans = RankSpans.of_ranks(ranks)
        self._margin_s = margin_s
        self._calls = HopCalls([c.target() for c in self._children])
        # Bound to the calls, not the hop: a hop dropped unclosed is still collected, and closed then.
        self._finalizer = weakref.finalize(self, self._calls.close)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank under this hop, ascending."""
        return self._ranks

    @property
    def children(self) -> tuple[HopChild, ...]:
        """The children the hop calls: what a ``Relay.Watch`` of it reads (control/relay_watch.py)."""
        return self._children

    def relay_step(self, args: RelayStepArgs) -> CombinedStep:
        """Every child's step, begun at once; their replies combined within ``args.timeout_s``."""
        return self._relay(STEP, args)

    def relay_evaluate(self, args: RelayEvaluateArgs) -> CombinedEvaluation:
        """Every child's evaluation, begun at once; their loss totals combined within ``args.timeout_s``."""
        return self._relay(EVALUATE, args)

    def relay_call(self, args: RelayCallArgs) -> CombinedReplies:
        """A report forwarded to every child at once; every rank's reply, in rank order, within
        ``args.timeout_s`` (a rank whose call failed carries its failure instead)."""
        return self._relay(FORWARDED, args)

    def _relay(self, call: RelayedCall[C], args: Args) -> C:
        began = time.monotonic()
        named = tuple((s.start, s.stop) for s in args.ranks)
        if named != self._spans.spans:
            raise RelayError(f"the {call.relay_method.name} names ranks {named} but this hop's subtree is ranks "
                             f"{self._spans.spans}: the caller's tree is not this hop's; rebuild both from the same "
                             "RelayTree")
        requests: list[UnaryRequest | None] = []
        unsent: dict[int, ZeroRayError] = {}
        cut = call.cut(args)
        for i, child in enumerate(self._children):
            try:
                requests.append(child.request(call, cut, args.timeout_s - (time.monotonic() - began),
                                              self._margin_s))
            except ZeroRayError as err:  # not sent: its failure, the others go on
                requests.append(None)
                unsent[i] = err
        outcomes = self._calls.call(requests, args.timeout_s - (time.monotonic() - began))
        return call.combine(self._reply(call, child, unsent.get(i), outcome, requests[i], args.timeout_s)
                            for i, (child, outcome) in enumerate(zip(self._children, outcomes)))

    @staticmethod
    def _reply(call: RelayedCall[C], child: HopChild, unsent: ZeroRayError | None, outcome: CallOutcome,
               request: UnaryRequest | None, timeout_s: float) -> C:
        # The method the child was (or was to be) called with; a relay child's is the call's own.
        operation = request.method.name if request is not None else \
            call.relay_method.name if isinstance(child, RelayChild) else "PartitionOwner"
        if unsent is not None:
            return _failed(call, child, _detail(unsent, child, operation))
        err = outcome.error
        if isinstance(err, grpc.RpcError):
            where = f"{operation} to {child.client.address}"
            err = convert_error(where, err, request.timeout_s if request is not None else None)
        if isinstance(err, ZeroRayError):
            return _failed(call, child, _detail(err, child, operation))
        if outcome.reply is None:  # still silent when the hop's time was up: the call was cancelled
            return _failed(call, child, FailureDetail(
                type=CallTimeout.__name__, rank=child.host, operation=operation,
                message=f"{operation} to {child.client.address} (rank {child.host}) did not answer within "
                        f"the {timeout_s:g}s the hop had"))
        try:
            return child.reply(call, outcome.reply)
        except ZeroRayError as err:
            return _failed(call, child, _detail(err, child, operation))

    def close(self) -> None:
        """Cancel the calls in flight (their steps come back failed) and end the hop's thread;
        a step after this raises RelayError. Idempotent."""
        self._finalizer()

    def failure_context(self) -> FailureContext:
        """What a failed RelayStep's FailureDetail says: the rank that serves this hop."""
        return FailureContext(rank=self._host, phase="relaying")


def close_relays(hops: Iterable[RelayHop], clients: Iterable[OwnerClient | RelayClient]) -> None:
    """Close ``hops`` (their calls in flight come back failed), then the clients they called."""
    for hop in hops:
        hop.close()
    for client in clients:
        client.close()


def hop_children(tree: RelayTree, relay_id: int | None, *, owners: Mapping[int, OwnerClient],
                 relays: Mapping[int, RelayClient]) -> tuple[HopChild, ...]:
    """The children of relay ``relay_id`` of ``tree`` (None: the driver's, the top relays), with
    the clients handed in: ``owners`` by rank, ``relays`` by relay id (only those it calls are
    read)."""
    relay = None if relay_id is None else tree.relay(relay_id)
    if relay is not None and relay.ranks:
        missing = [r for r in relay.ranks if r not in owners]
        if missing:
            raise ConfigError(f"relay {relay_id} calls ranks {list(relay.ranks)} but no owner client was handed in "
                              f"for {missing}: pass a client for every rank it calls")
        return tuple(OwnerChild(rank=r, node=tree.nodes[r], client=owners[r]) for r in relay.ranks)
    below = tree.driver_children if relay is None else tree.children(relay.id)
    missing = [c.id for c in below if c.id not in relays]
    if missing:
        raise ConfigError(f"{'the driver' if relay is None else f'relay {relay_id}'} calls relays "
                          f"{[c.id for c in below]} but no relay client was handed in for {missing}")
    return tuple(RelayChild(relay=c.id, ranks=tree.ranks_under(c.id), host=c.host, node=tree.nodes[c.host],
                            client=relays[c.id]) for c in below)
