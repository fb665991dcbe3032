"""The calls the relay tree carries (issue 44), each as one :class:`RelayedCall`: what a hop
asks an owner child (a ``PartitionOwner`` method and its request) and a relay child (a
``Relay`` method), and how their replies become one combined reply.

A hop (:mod:`zero_ray.control.relay_hop`) is the same for every call: it cuts the request for
each child, sends them at once, names a child that failed, and combines. What differs is only
this: a step and an evaluation (:class:`PackedCall`: one packed request, replies combined into
figures) and a forwarded report (:data:`FORWARDED`: one serialized request for every rank, the
replies kept per rank, unparsed). A call added to the tree is one here and its methods on the
hop, the host, the servicer and the client.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from zero_ray.control._generated import common_pb2, owner_pb2, owner_pb2_grpc, relay_pb2, relay_pb2_grpc
from zero_ray.control.conversion import to_message, to_record
from zero_ray.control.handlers import (
    EvaluateResult,
    Flight,
    OwnerStats,
    OwnerStatus,
    RelayCallArgs,
    RelayEvaluateArgs,
    RelayStepArgs,
    StepResult,
    SubtreeReplies,
)
from zero_ray.control.hop_calls import UnaryMethod
from zero_ray.control.relay_wire import evaluation_from_message, replies_from_wire, step_from_message
from zero_ray.core.reply_combine import (
    CombinedEvaluation,
    CombinedReplies,
    CombinedStep,
    RankFailure,
    RankSpans,
    combine_evaluations,
    combine_replies,
    combine_steps,
)
from zero_ray.errors import ConfigError, RelayError

__all__ = ["EVALUATE", "FORWARDED", "STEP", "ForwardedCall", "PackedCall", "PackedCut", "RelayedCall", "RequestCut",
           "abort_args", "forwarded_args", "forwarded_results"]

C = TypeVar("C", CombinedStep, CombinedEvaluation, CombinedReplies)
Args = RelayStepArgs | RelayEvaluateArgs | RelayCallArgs


class RelayedCall(Generic[C]):
    """One kind of call of the relay tree, as a hop makes it."""

    relay_method: UnaryMethod
    relay_message: type[Any]

    def cut(self, args: Any) -> RequestCut:
        """``args`` ready to be cut into each child's request (once a batch, before its children's)."""
        return RequestCut(self, args)

    def owner_request(self, args: Any, rank: int, header: common_pb2.RequestHeader) -> tuple[UnaryMethod, Any]:
        """The owner's method and request message for rank ``rank``."""
        raise NotImplementedError

    def of_owner(self, message: Any, rank: int, address: str) -> C:
        """Rank ``rank``'s reply message, combined (RelayError when it is another rank's)."""
        raise NotImplementedError

    def relay_request(self, args: Any, ranks: tuple[int, ...], *, timeout_s: float, relay: int,
                      header: common_pb2.RequestHeader) -> Any:
        """A relay child's request message for ``ranks``."""
        return to_message(args.for_ranks(ranks, timeout_s=timeout_s, relay=relay), self.relay_message, header=header)

    def of_relay(self, message: Any) -> C:
        """A relay child's reply message, as its combined reply."""
        raise NotImplementedError

    def failed(self, spans: RankSpans, failure: RankFailure) -> C:
        """A child's failed call: its ranks, and why."""
        raise NotImplementedError

    def combine(self, replies: Iterable[C]) -> C:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class PackedCall(RelayedCall[C]):
    """A call whose request is packed (``RelayStepArgs``, ``RelayEvaluateArgs``: one common
    request and each rank's indices) and whose replies combine into figures: the owner's
    method, request message and reply record (it has the owner's ``rank``), the relay's method,
    request message and reply record (read by ``from_wire``), and the combined reply ``C``."""

    owner_method: UnaryMethod
    owner_message: type[Any]
    owner_result: type[Any]
    relay_method: UnaryMethod
    relay_message: type[Any]
    common_field: str  # the request's field (and the args' record) every rank runs: "step", "evaluate"
    from_message: Callable[[Any], C]  # a relay's reply message, read straight into ``C`` (relay_wire)
    combined: type[C]
    combine_all: Callable[[Iterable[C]], C]

    def cut(self, args: Any) -> PackedCut:
        return PackedCut(self, args)

    def owner_request(self, args: Any, rank: int, header: common_pb2.RequestHeader) -> tuple[UnaryMethod, Any]:
        return self.owner_method, to_message(args.rank_args(rank), self.owner_message, header=header)

    def of_owner(self, message: Any, rank: int, address: str) -> C:
        result = to_record(message, self.owner_result)
        if result.rank != rank:
            raise RelayError(f"the owner at {address} answered rank {rank}'s {self.owner_method.name} as rank "
                             f"{result.rank}: the hop was built with another pool's addresses; rebuild it from the "
                             "pool's current ranks")
        return self.combined.of(result)

    def of_relay(self, message: Any) -> C:
        return self.from_message(message)

    def failed(self, spans: RankSpans, failure: RankFailure) -> C:
        return self.combined(ranks=spans, failure=failure)

    def combine(self, replies: Iterable[C]) -> C:
        return self.combine_all(replies)


class RequestCut:
    """A batch's request, cut per child: what a hop asks each owner child and each relay child
    (the call's own methods; :class:`PackedCut` does it faster for the packed calls)."""

    _call: RelayedCall[Any]
    _args: Any

    def __init__(self, call: RelayedCall[Any], args: Any) -> None:
        self._call = call
        self._args = args

    def owner_request(self, rank: int, header: common_pb2.RequestHeader) -> tuple[UnaryMethod, Any]:
        """Rank ``rank``'s owner's method and request message."""
        return self._call.owner_request(self._args, rank, header)

    def relay_request(self, spans: tuple[tuple[int, int], ...], *, timeout_s: float, relay: int,
                      header: common_pb2.RequestHeader) -> Any:
        """The request message of relay ``relay``, over the ranks ``spans`` (start, stop) name."""
        ranks = tuple(r for a, b in spans for r in range(a, b))
        return self._call.relay_request(self._args, ranks, timeout_s=timeout_s, relay=relay, header=header)


class PackedCut(RequestCut):
    """A packed request (``RelayStepArgs``, ``RelayEvaluateArgs``) cut per child at protobuf's
    speed: what every rank runs is converted to its message once a batch, each child's message a
    copy of it (C) with the child's header, spans, counts and indices sliced in. Converting each
    child's record instead (``for_ranks`` / ``rank_args``, then ``to_message``) cost a top relay
    26 us a child; the messages are equal (tests/control/test_control_relay_wire.py). With the
    replies read straight from their messages (relay_wire), a top relay's server threads went from
    1.8-2.0 to 1.2-1.3 ms of CPU a step at 1,024 owners; what is left of its ~4 ms is gRPC's."""

    _owner_base: Any
    _relay_base: Any
    _firsts: list[int]
    _positions: list[int]
    _offsets: list[int]

    def __init__(self, call: PackedCall[Any], args: Any) -> None:
        super().__init__(call, args)
        self._owner_base = to_message(getattr(args, call.common_field), call.owner_message)
        self._relay_base = call.relay_message()
        getattr(self._relay_base, call.common_field).CopyFrom(self._owner_base)
        self._firsts = [s.start for s in args.ranks]
        self._positions = list(itertools.accumulate((s.stop - s.start for s in args.ranks), initial=0))
        self._offsets = list(itertools.accumulate(args.counts, initial=0)) if args.counts else []

    def _position(self, start: int, stop: int) -> int:
        """Where ranks ``start`` to ``stop - 1`` begin in rank order (ConfigError unless they
        are all this call's)."""
        i = bisect.bisect_right(self._firsts, start) - 1
        if i < 0 or stop > self._args.ranks[i].stop:
            raise ConfigError(f"ranks {start}-{stop - 1} are not all among this call's ranks "
                              f"{[(s.start, s.stop) for s in self._args.ranks]}")
        return self._positions[i] + start - self._firsts[i]

    def owner_request(self, rank: int, header: common_pb2.RequestHeader) -> tuple[UnaryMethod, Any]:
        call: PackedCall[Any] = self._call  # type: ignore[assignment]
        message = call.owner_message()
        message.CopyFrom(self._owner_base)
        message.header.CopyFrom(header)
        at = self._position(rank, rank + 1)
        if self._offsets:
            message.piece.indices.extend(self._args.indices[self._offsets[at]:self._offsets[at + 1]])
        return call.owner_method, message

    def relay_request(self, spans: tuple[tuple[int, int], ...], *, timeout_s: float, relay: int,
                      header: common_pb2.RequestHeader) -> Any:
        message = self._call.relay_message()
        message.CopyFrom(self._relay_base)
        message.header.CopyFrom(header)
        message.timeout_s = timeout_s
        message.relay = relay
        for start, stop in spans:
            message.ranks.add(start=start, stop=stop)
            a = self._position(start, stop)
            b = a + stop - start
            if self._offsets:
                message.counts.extend(self._args.counts[a:b])
                message.indices.extend(self._args.indices[self._offsets[a]:self._offsets[b]])
        return message


def _forwarded_method(name: str) -> UnaryMethod:
    # No serializers: the request goes as the bytes the caller serialized, the reply comes back unparsed.
    return UnaryMethod(name=f"PartitionOwner.{name}",
                       rpc=lambda ch: ch.unary_unary(f"/zero_ray.v1.PartitionOwner/{name}"))


class ForwardedCall(RelayedCall[CombinedReplies]):
    """A report (``RelayCallArgs``): the same serialized request to every rank, each rank's
    reply kept as it came, in rank order. A relay parses neither, so it adds no work per field."""

    relay_method = UnaryMethod(name="Relay.RelayCall", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayCall)
    relay_message = relay_pb2.RelayCallRequest

    def owner_request(self, args: Any, rank: int, header: common_pb2.RequestHeader) -> tuple[UnaryMethod, Any]:
        return _forwarded_method(args.method), args.request

    def of_owner(self, message: Any, rank: int, address: str) -> CombinedReplies:
        return CombinedReplies.of(rank, message)

    def of_relay(self, message: Any) -> CombinedReplies:
        return replies_from_wire(to_record(message, SubtreeReplies))

    def failed(self, spans: RankSpans, failure: RankFailure) -> CombinedReplies:
        return CombinedReplies.failed(ranks=spans, failure=failure)

    def combine(self, replies: Iterable[CombinedReplies]) -> CombinedReplies:
        return combine_replies(replies)


STEP: PackedCall[CombinedStep] = PackedCall(
    owner_method=UnaryMethod(name="PartitionOwner.Step", rpc=lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Step),
    owner_message=owner_pb2.StepRequest, owner_result=StepResult,
    relay_method=UnaryMethod(name="Relay.RelayStep", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayStep),
    relay_message=relay_pb2.RelayStepRequest, common_field="step", from_message=step_from_message,
    combined=CombinedStep, combine_all=combine_steps)

EVALUATE: PackedCall[CombinedEvaluation] = PackedCall(
    owner_method=UnaryMethod(name="PartitionOwner.Evaluate",
                             rpc=lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Evaluate),
    owner_message=owner_pb2.EvaluateRequest, owner_result=EvaluateResult,
    relay_method=UnaryMethod(name="Relay.RelayEvaluate", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayEvaluate),
    relay_message=relay_pb2.RelayEvaluateRequest, common_field="evaluate", from_message=evaluation_from_message,
    combined=CombinedEvaluation, combine_all=combine_evaluations)

FORWARDED = ForwardedCall()


# Each forwarded method's request message (a header alone: the same for every rank), reply message
# and reply record.
_FORWARDED_TYPES: dict[str, tuple[type[Any], type[Any], type[Any]]] = {
    "Stats": (owner_pb2.StatsRequest, owner_pb2.StatsReply, OwnerStats),
    "Flight": (owner_pb2.FlightRequest, owner_pb2.FlightReply, Flight),
    "Status": (owner_pb2.OwnerStatusRequest, owner_pb2.OwnerStatusReply, OwnerStatus),
}


def forwarded_args(method: str, header: common_pb2.RequestHeader, *, ranks: Iterable[int],
                   timeout_s: float) -> RelayCallArgs:
    """The RelayCall of ``method`` (one of ``handlers.FORWARDED_METHODS``) for ``ranks``, its
    request serialized once for all of them."""
    request_type = _FORWARDED_TYPES[method][0]
    return RelayCallArgs.of(method, request_type(header=header).SerializeToString(), ranks=list(ranks),
                            timeout_s=timeout_s)


def abort_args(header: common_pb2.RequestHeader, *, reason: str, generation: int, ranks: Iterable[int],
               timeout_s: float, relay: int) -> RelayCallArgs:
    """The RelayCall of ``Abort`` (``generation``'s collectives, for ``reason``) on every rank of
    relay ``relay``'s subtree, ``ranks``: its request serialized once for all of them."""
    request = owner_pb2.AbortRequest(header=header, reason=reason, generation=generation)
    return RelayCallArgs.of("Abort", request.SerializeToString(), ranks=list(ranks), timeout_s=timeout_s,
                            relay=relay)


def forwarded_results(method: str, replies: CombinedReplies) -> list[Any]:
    """Every rank's reply record (``OwnerStats`` for Stats, ...), in rank order; the ranks whose
    call failed left out (check ``replies.failure`` first where none may fail)."""
    _, reply_type, record = _FORWARDED_TYPES[method]
    return [to_record(reply_type.FromString(o.reply), record) for o in replies.replies if o.failure is None]
