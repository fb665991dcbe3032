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
    SubtreeEvaluation,
    SubtreeReplies,
    SubtreeStep,
)
from zero_ray.control.hop_calls import UnaryMethod
from zero_ray.control.relay_wire import evaluation_from_wire, from_wire, replies_from_wire
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
from zero_ray.errors import RelayError

__all__ = ["EVALUATE", "FORWARDED", "STEP", "ForwardedCall", "PackedCall", "RelayedCall", "abort_args",
           "forwarded_args", "forwarded_results"]

C = TypeVar("C", CombinedStep, CombinedEvaluation, CombinedReplies)
Args = RelayStepArgs | RelayEvaluateArgs | RelayCallArgs


class RelayedCall(Generic[C]):
    """One kind of call of the relay tree, as a hop makes it."""

    relay_method: UnaryMethod
    relay_message: type[Any]

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
    relay_result: type[Any]
    from_wire: Callable[[Any], C]
    combined: type[C]
    combine_all: Callable[[Iterable[C]], C]

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
        return self.from_wire(to_record(message, self.relay_result))

    def failed(self, spans: RankSpans, failure: RankFailure) -> C:
        return self.combined(ranks=spans, failure=failure)

    def combine(self, replies: Iterable[C]) -> C:
        return self.combine_all(replies)


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
    relay_message=relay_pb2.RelayStepRequest, relay_result=SubtreeStep, from_wire=from_wire,
    combined=CombinedStep, combine_all=combine_steps)

EVALUATE: PackedCall[CombinedEvaluation] = PackedCall(
    owner_method=UnaryMethod(name="PartitionOwner.Evaluate",
                             rpc=lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Evaluate),
    owner_message=owner_pb2.EvaluateRequest, owner_result=EvaluateResult,
    relay_method=UnaryMethod(name="Relay.RelayEvaluate", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayEvaluate),
    relay_message=relay_pb2.RelayEvaluateRequest, relay_result=SubtreeEvaluation, from_wire=evaluation_from_wire,
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
