"""A relay's combined reply survives the wire exactly: CombinedStep -> SubtreeStep record ->
RelayStepReply bytes -> record -> CombinedStep gives the same value, whatever it holds, and a
malformed reply is refused at the door."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from zero_ray.control._generated import common_pb2, relay_pb2
from zero_ray.control.conversion import to_message, to_record
from zero_ray.control.handlers import (
    EvaluateArgs,
    LossTotals,
    Piece,
    RankSpan,
    RelayEvaluateArgs,
    RelayStepArgs,
    StepArgs,
    StepResult,
    SubtreeEvaluation,
    SubtreeStep,
)
from zero_ray.control.relay_calls import EVALUATE, STEP
from zero_ray.control.relay_wire import (
    evaluation_from_message,
    evaluation_from_wire,
    evaluation_to_wire,
    from_wire,
    step_from_message,
    to_wire,
    units_from_bytes,
    units_to_bytes,
)
from zero_ray.core.reply_combine import CombinedEvaluation, CombinedStep, ExactSum, RankFailure, combine_steps
from zero_ray.errors import ConfigError, FailureDetail, RelayError

_FLOATS = (0.1, 1e-300, 5e-324, 1.7976931348623157e308, -2.5, 0.0, -0.0, 3.0)


def _through_the_wire(step: CombinedStep) -> CombinedStep:
    data = to_message(to_wire(step), relay_pb2.RelayStepReply).SerializeToString()
    message = relay_pb2.RelayStepReply.FromString(data)
    read = from_wire(to_record(message, SubtreeStep))
    # A hop reads the message itself: the same step as through the record.
    assert step_from_message(message) == read
    evaluation = CombinedEvaluation(ranks=step.ranks, totals=step.totals, failure=step.failure)
    eval_message = relay_pb2.RelayEvaluateReply.FromString(
        to_message(evaluation_to_wire(evaluation), relay_pb2.RelayEvaluateReply).SerializeToString())
    assert evaluation_from_message(eval_message) == evaluation_from_wire(
        to_record(eval_message, SubtreeEvaluation)) == evaluation
    return read


def _result(rng: random.Random, rank: int, *, counted: bool, nonfinite: bool) -> StepResult:
    samples = rng.choice([0, 1, 7])
    totals = LossTotals(loss_sum=rng.choice(_FLOATS) * samples, samples=samples, count=rng.choice(_FLOATS),
                        counted=counted, items=rng.random() * 1e6)
    return StepResult(totals=totals, grad_norm=0.75, lr=3e-4, skipped=nonfinite, loss_scale=1024.0,
                      compute_seconds=rng.random(), data_seconds=rng.random() / 3, rank=rank,
                      bytes_sent={"reduce_scatter": rng.randint(0, 2**40), f"kind{rank % 3}": rank},
                      nonfinite_loss_ranks=(2,) if nonfinite else (), nonfinite_grad_ranks=(0, 2) if nonfinite else ())


@pytest.mark.parametrize("seed", range(12))
def test_a_combined_reply_survives_the_wire_exactly(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 40)
    counted, nonfinite = rng.random() < 0.5, rng.random() < 0.3
    replies = [CombinedStep.of(_result(rng, r, counted=counted, nonfinite=nonfinite)) for r in range(world)]
    for rank in rng.sample(range(world), rng.randint(0, min(2, world))):
        detail = FailureDetail(type="CollectiveError", message=f"rank {rank} ✗", rank=rank if seed % 2 else None,
                               phase="backward", cause="OSError: reset", remote_traceback="Traceback ...",
                               operation="PartitionOwner.Step")
        replies[rank] = CombinedStep.failed(RankFailure(rank=rank, node=f"n{rank // 8}", detail=detail,
                                                        at=1.7e9 + rng.random()))
    rng.shuffle(replies)  # spans arrive in any order and merge
    step = combine_steps(replies)
    assert _through_the_wire(step) == step


def test_empty_and_failed_only_replies_and_non_finite_sums_survive() -> None:
    failed = CombinedStep.failed(RankFailure(rank=9, node="n1", at=1.0,
                                             detail=FailureDetail(type="CallTimeout", message="late", rank=9)))
    odd = CombinedStep(data_seconds_sum=ExactSum.of(math.inf, -math.inf, math.nan, -1.5))
    for step in (CombinedStep(), failed, odd):
        assert _through_the_wire(step) == step
    assert math.isnan(_through_the_wire(odd).data_seconds_sum.value)


def test_units_travel_as_signed_big_endian_bytes() -> None:
    for units in (0, 1, -1, 127, 128, -128, -129, 2**1074, -(2**2098) + 3):
        assert units_from_bytes(units_to_bytes(units)) == units
    assert units_to_bytes(0) == b"" and units_to_bytes(255) == b"\x00\xff" and units_to_bytes(-1) == b"\xff"
    # 2.5 is 2.5 * 2**1074 units: 1,076 bits, 135 bytes
    assert len(to_wire(CombinedStep(data_seconds_sum=ExactSum.of(2.5))).data_seconds_sum.units) == 135


def test_a_malformed_reply_is_refused_at_the_door() -> None:
    record = to_wire(CombinedStep.failed(RankFailure(rank=3, node="n0", at=1.0,
                                                     detail=FailureDetail(type="X", message="m"))))
    overlapping = dataclasses.replace(record, ranks=(RankSpan(start=0, stop=4), RankSpan(start=3, stop=5)))
    with pytest.raises(RelayError, match="combined twice"):
        from_wire(overlapping)
    with pytest.raises(RelayError, match="is empty"):
        from_wire(dataclasses.replace(record, ranks=(RankSpan(start=2, stop=2),)))


def _packed(rng: random.Random, kind: str) -> RelayStepArgs | RelayEvaluateArgs:
    spans = []
    start = rng.randint(0, 5)
    for _ in range(rng.randint(1, 4)):  # ascending spans with gaps, as a re-parented subtree's
        stop = start + rng.randint(1, 9)
        spans.append((start, stop))
        start = stop + rng.randint(1, 3)
    ranks = [r for a, b in spans for r in range(a, b)]
    staged = rng.random() < 0.25
    piece = Piece(batch_key="k:3") if staged else Piece(dataset="train")
    counts = [] if staged else [rng.randint(0, 4) for _ in ranks]
    indices = [rng.randint(0, 2**40) for _ in range(sum(counts))]
    if kind == "step":
        step = StepArgs(step=7, piece=piece, global_samples=len(indices), generation=3, samples_seen=99, ahead=True)
        return RelayStepArgs.of(step, ranks=ranks, counts=counts, indices=indices, timeout_s=30.0, relay=4)
    evaluate = EvaluateArgs(piece=piece, generation=3)
    return RelayEvaluateArgs.of(evaluate, ranks=ranks, counts=counts, indices=indices, timeout_s=30.0, relay=4)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("kind", ["step", "evaluate"])
def test_a_hops_cut_requests_equal_each_childs_converted_record(seed: int, kind: str) -> None:
    """PackedCut builds each child's message from the parent's at protobuf speed; each equals
    the message of the child's own record (for_ranks / rank_args), as the hop built it before."""
    rng = random.Random(seed)
    call = STEP if kind == "step" else EVALUATE
    args = _packed(rng, kind)
    header = common_pb2.RequestHeader(job_id=f"job-{seed}", protocol_version=3)
    cut = call.cut(args)
    ranks = list(args.rank_list)
    for rank in ranks:
        method, message = cut.owner_request(rank, header)
        assert method is call.owner_method
        assert message == to_message(args.rank_args(rank), call.owner_message, header=header)
    for _ in range(4):
        child = sorted(rng.sample(ranks, rng.randint(1, len(ranks))))
        spans = [(child[0], child[0] + 1)]
        for r in child[1:]:
            spans[-1:] = [(spans[-1][0], r + 1)] if r == spans[-1][1] else [spans[-1], (r, r + 1)]
        message = cut.relay_request(tuple(spans), timeout_s=12.5, relay=9, header=header)
        assert message == to_message(args.for_ranks(child, timeout_s=12.5, relay=9), call.relay_message,
                                     header=header)
    outside = max(ranks) + 1
    with pytest.raises(ConfigError, match="not all among this call's ranks"):
        cut.owner_request(outside, header)
    with pytest.raises(ConfigError, match="not all among this call's ranks"):
        cut.relay_request(((ranks[0], outside + 1),), timeout_s=1.0, relay=1, header=header)
