"""The calls the relay tree carries (issue 44), each as one :class:`RelayedCall`: what a hop
asks an owner child (``PartitionOwner``'s method and request) and a relay child (``Relay``'s),
and how their replies become one combined reply.

A hop (:mod:`zero_ray.control.relay_hop`) is the same for every call: it cuts the packed
request for each child, sends them at once, names a child that failed, and combines. What
differs between a step and an evaluation is only this table, so a call added to the tree is a
``RelayedCall`` here and its methods on the hop, the host, the servicer and the client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from zero_ray.control._generated import owner_pb2, owner_pb2_grpc, relay_pb2, relay_pb2_grpc
from zero_ray.control.handlers import EvaluateResult, StepResult, SubtreeEvaluation, SubtreeStep
from zero_ray.control.hop_calls import UnaryMethod
from zero_ray.control.relay_wire import evaluation_from_wire, from_wire
from zero_ray.core.reply_combine import (
    CombinedEvaluation,
    CombinedStep,
    RankFailure,
    RankSpans,
    combine_evaluations,
    combine_steps,
)

__all__ = ["EVALUATE", "STEP", "RelayedCall"]

C = TypeVar("C", CombinedStep, CombinedEvaluation)


@dataclass(frozen=True, kw_only=True)
class RelayedCall(Generic[C]):
    """One call of the relay tree: the owner's method, request message and reply record
    (``owner_result``: it has the owner's ``rank``), the relay's method, request message and
    reply record (``relay_result``, read by ``from_wire``), and the combined reply ``C`` (one
    rank's from ``C.of``, a failed child's ``C(ranks=..., failure=...)``, several by
    ``combine``)."""

    owner_method: UnaryMethod
    owner_request: type[Any]
    owner_result: type[Any]
    relay_method: UnaryMethod
    relay_request: type[Any]
    relay_result: type[Any]
    from_wire: Callable[[Any], C]
    combined: type[C]
    combine: Callable[[Iterable[C]], C]

    def of_owner(self, result: Any) -> C:
        """One owner's reply record, combined."""
        return self.combined.of(result)

    def failed(self, spans: RankSpans, failure: RankFailure) -> C:
        """A child's failed call: its ranks, and why."""
        return self.combined(ranks=spans, failure=failure)


STEP: RelayedCall[CombinedStep] = RelayedCall(
    owner_method=UnaryMethod(name="PartitionOwner.Step", rpc=lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Step),
    owner_request=owner_pb2.StepRequest, owner_result=StepResult,
    relay_method=UnaryMethod(name="Relay.RelayStep", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayStep),
    relay_request=relay_pb2.RelayStepRequest, relay_result=SubtreeStep, from_wire=from_wire,
    combined=CombinedStep, combine=combine_steps)

EVALUATE: RelayedCall[CombinedEvaluation] = RelayedCall(
    owner_method=UnaryMethod(name="PartitionOwner.Evaluate",
                             rpc=lambda ch: owner_pb2_grpc.PartitionOwnerStub(ch).Evaluate),
    owner_request=owner_pb2.EvaluateRequest, owner_result=EvaluateResult,
    relay_method=UnaryMethod(name="Relay.RelayEvaluate", rpc=lambda ch: relay_pb2_grpc.RelayStub(ch).RelayEvaluate),
    relay_request=relay_pb2.RelayEvaluateRequest, relay_result=SubtreeEvaluation, from_wire=evaluation_from_wire,
    combined=CombinedEvaluation, combine=combine_evaluations)
