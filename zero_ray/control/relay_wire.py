"""A relay's combined step reply (:class:`zero_ray.core.reply_combine.CombinedStep`) as its wire
record (``SubtreeStep``, relay.proto's ``RelayStepReply``) and back, exactly (and a combined
evaluation, ``CombinedEvaluation`` as ``SubtreeEvaluation``): converted at the
door, by the Relay servicer on the way out and the Relay client on the way in, so that a relay
and the driver only ever hold ``CombinedStep``.

An ``ExactSum``'s units (an integer of up to about 2,100 bits) travel as signed big-endian
bytes rather than a decimal string: a third of the size, and no parsing. A record that
arrives malformed (overlapping rank spans, a failure at a non-finite time) is refused here
with the domain error ``reply_combine`` raises for it.

A hop reads its relay children's replies straight from their messages (:func:`step_from_message`,
:func:`evaluation_from_message`): the same ``CombinedStep`` as ``from_wire`` of the converted
record, without the twenty-odd records that conversion builds on the way (a top relay's 8 replies
cost it 0.3 ms a step that way at 1,024 owners).
"""

from __future__ import annotations

from typing import Any

from zero_ray.control.conversion import to_record
from zero_ray.control.handlers import (
    ExactSumValue,
    FailedRank,
    FailureDetailRecord,
    RankSpan,
    RankReply,
    StepAgreed,
    SubtreeEvaluation,
    SubtreeReplies,
    SubtreeStep,
    SubtreeTotals,
)
from zero_ray.core.reply_combine import (
    Agreed,
    CombinedEvaluation,
    CombinedReplies,
    CombinedStep,
    CombinedTotals,
    ExactSum,
    RankFailure,
    RankOutcome,
    RankSpans,
    StepAgreement,
)
from zero_ray.errors import FailureDetail, RelayError

__all__ = ["evaluation_from_message", "evaluation_from_wire", "evaluation_to_wire", "from_wire", "replies_from_wire",
           "replies_to_wire", "step_from_message", "to_wire", "units_from_bytes", "units_to_bytes"]


def units_to_bytes(units: int) -> bytes:
    """``units`` as the fewest signed big-endian bytes (none for 0)."""
    return units.to_bytes((units.bit_length() + 8) // 8, "big", signed=True) if units else b""


def units_from_bytes(data: bytes) -> int:
    """The integer :func:`units_to_bytes` wrote."""
    return int.from_bytes(data, "big", signed=True)


def _sum_out(s: ExactSum) -> ExactSumValue:
    return ExactSumValue(units=units_to_bytes(s.units), pos_inf=s.pos_inf, neg_inf=s.neg_inf, nan=s.nan)


def _sum_in(v: ExactSumValue) -> ExactSum:
    return ExactSum(units=units_from_bytes(v.units), pos_inf=v.pos_inf, neg_inf=v.neg_inf, nan=v.nan)


def _totals_out(t: CombinedTotals) -> SubtreeTotals:
    return SubtreeTotals(loss_sum=_sum_out(t.loss_sum), samples=t.samples, count=_sum_out(t.count),
                         items=_sum_out(t.items), counted=None if t.counted is None else t.counted.value,
                         counted_rank=0 if t.counted is None else t.counted.rank)


def _totals_in(t: SubtreeTotals, *, counted_set: bool | None = None) -> CombinedTotals:
    # counted_set: whether ``counted`` was sent, for a message (a record has None when it was not)
    sent = t.counted is not None if counted_set is None else counted_set
    return CombinedTotals(loss_sum=_sum_in(t.loss_sum), samples=t.samples, count=_sum_in(t.count),
                          items=_sum_in(t.items), counted=Agreed(value=t.counted, rank=t.counted_rank) if sent else None)


def _failure_out(f: RankFailure) -> FailedRank:
    d = f.detail
    return FailedRank(rank=f.rank, node=f.node, at=f.at,
                      detail=FailureDetailRecord(type=d.type, rank=d.rank, phase=d.phase, message=d.message,
                                                 cause=d.cause, remote_traceback=d.remote_traceback,
                                                 operation=d.operation))


def _failure_in(f: FailedRank) -> RankFailure:
    d = f.detail
    return RankFailure(rank=f.rank, node=f.node, at=f.at,
                       detail=FailureDetail(type=d.type, message=d.message, rank=d.rank, phase=d.phase, cause=d.cause,
                                            remote_traceback=d.remote_traceback, operation=d.operation))


def _spans_in(spans: tuple[RankSpan, ...]) -> RankSpans:
    out = RankSpans()
    for s in spans:
        if s.start >= s.stop:
            raise RelayError(f"a relay's reply holds the rank span [{s.start}, {s.stop}), which is empty: a span is "
                             "its ranks start to stop - 1; the relay that sent it is not speaking this protocol")
        out = out + RankSpans(spans=((s.start, s.stop),))  # refuses overlapping spans
    return out


def to_wire(step: CombinedStep) -> SubtreeStep:
    """``step`` as the record the wire carries."""
    a = step.agreed
    agreed = None if a is None else StepAgreed(grad_norm=a.value.grad_norm, lr=a.value.lr, skipped=a.value.skipped,
                                               loss_scale=a.value.loss_scale, refused=a.value.refused, rank=a.rank)
    return SubtreeStep(ranks=tuple(RankSpan(start=start, stop=stop) for start, stop in step.ranks.spans),
                       totals=_totals_out(step.totals), agreed=agreed, compute_seconds=step.compute_seconds,
                       data_seconds=step.data_seconds, data_seconds_sum=_sum_out(step.data_seconds_sum),
                       bytes_sent=dict(step.bytes_sent), nonfinite_loss_ranks=step.nonfinite_loss_ranks,
                       nonfinite_grad_ranks=step.nonfinite_grad_ranks,
                       failure=None if step.failure is None else _failure_out(step.failure))


def _step_in(r: Any, *, totals: CombinedTotals, agreed: Any, failure: RankFailure | None) -> CombinedStep:
    # ``r``: a SubtreeStep record or a RelayStepReply message (the same field names); the fields
    # that read differently from the two (optional ones) are the caller's.
    a = agreed
    return CombinedStep(ranks=_spans_in(r.ranks), totals=totals,
                        agreed=None if a is None else Agreed(value=StepAgreement(
                            grad_norm=a.grad_norm, lr=a.lr, skipped=a.skipped, loss_scale=a.loss_scale,
                            refused=a.refused), rank=a.rank),
                        compute_seconds=r.compute_seconds, data_seconds=r.data_seconds,
                        data_seconds_sum=_sum_in(r.data_seconds_sum), bytes_sent=tuple(sorted(r.bytes_sent.items())),
                        nonfinite_loss_ranks=tuple(sorted(set(r.nonfinite_loss_ranks))),
                        nonfinite_grad_ranks=tuple(sorted(set(r.nonfinite_grad_ranks))), failure=failure)


def from_wire(record: SubtreeStep) -> CombinedStep:
    """The ``CombinedStep`` that :func:`to_wire` wrote."""
    return _step_in(record, totals=_totals_in(record.totals), agreed=record.agreed,
                    failure=None if record.failure is None else _failure_in(record.failure))


def evaluation_to_wire(evaluation: CombinedEvaluation) -> SubtreeEvaluation:
    """``evaluation`` as the record the wire carries (relay.proto's RelayEvaluateReply)."""
    return SubtreeEvaluation(ranks=tuple(RankSpan(start=start, stop=stop) for start, stop in evaluation.ranks.spans),
                             totals=_totals_out(evaluation.totals),
                             failure=None if evaluation.failure is None else _failure_out(evaluation.failure))


def evaluation_from_wire(record: SubtreeEvaluation) -> CombinedEvaluation:
    """The ``CombinedEvaluation`` that :func:`evaluation_to_wire` wrote."""
    return CombinedEvaluation(ranks=_spans_in(record.ranks), totals=_totals_in(record.totals),
                              failure=None if record.failure is None else _failure_in(record.failure))


def replies_to_wire(replies: CombinedReplies) -> SubtreeReplies:
    """``replies`` as the record the wire carries (relay.proto's RelayCallReply)."""
    return SubtreeReplies(replies=tuple(RankReply(rank=o.rank, reply=o.reply,
                                                  failure=None if o.failure is None else _failure_out(o.failure))
                                        for o in replies.replies))


def replies_from_wire(record: SubtreeReplies) -> CombinedReplies:
    """The ``CombinedReplies`` that :func:`replies_to_wire` wrote (ranks named twice refused)."""
    ranks = RankSpans.of_ranks(sorted(r.rank for r in record.replies))
    outcomes = tuple(sorted((RankOutcome(rank=r.rank, reply=r.reply,
                                         failure=None if r.failure is None else _failure_in(r.failure))
                             for r in record.replies), key=lambda o: o.rank))
    return CombinedReplies(ranks=ranks, replies=outcomes)


# The readers below take relay.proto's messages themselves; _sum_in, _spans_in, _totals_in and
# _step_in read the same field names from a message as from its record.

def _totals_of(t: Any) -> CombinedTotals:
    return _totals_in(t, counted_set=t.HasField("counted"))


def _failure_of(message: Any) -> RankFailure | None:
    # Rare (a failed step): the generic conversion, which reads FailureDetail's optional rank.
    return _failure_in(to_record(message.failure, FailedRank)) if message.HasField("failure") else None


def step_from_message(message: Any) -> CombinedStep:
    """A ``RelayStepReply`` as its ``CombinedStep``: ``from_wire(to_record(message, SubtreeStep))``."""
    return _step_in(message, totals=_totals_of(message.totals),
                    agreed=message.agreed if message.HasField("agreed") else None, failure=_failure_of(message))


def evaluation_from_message(message: Any) -> CombinedEvaluation:
    """A ``RelayEvaluateReply`` as its ``CombinedEvaluation``: ``evaluation_from_wire`` of its record."""
    return CombinedEvaluation(ranks=_spans_in(message.ranks), totals=_totals_of(message.totals),
                              failure=_failure_of(message))
