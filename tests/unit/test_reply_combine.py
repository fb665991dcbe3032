"""Step replies combined up a relay tree (zero_ray/core/reply_combine.py): any tree shape and any
order give exactly what combining every reply at once gives, and the driver's StepMetrics from
the combined reply are today's from the list of replies."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable

import pytest

from zero_ray.control.handlers import combine
from zero_ray.core.records import EvaluateResult, LossTotals, StepResult
from zero_ray.core.reply_combine import (
    CombinedEvaluation,
    CombinedReplies,
    CombinedStep,
    CombinedTotals,
    ExactSum,
    RankFailure,
    RankSpans,
    combine_evaluations,
    combine_replies,
    combine_steps,
)
from zero_ray.driver.reports import StepMetrics
from zero_ray.errors import FailureDetail, RelayError, ReplyMismatchError


def _dyadic(rng: random.Random) -> float:
    """A float whose sums with its like are exact in float arithmetic: today's left-to-right
    sum and the exact one round alike."""
    return rng.randint(-2 ** 20, 2 ** 20) / 1024


def _wild(rng: random.Random) -> float:
    """A float of any magnitude, whose sums round differently in different orders."""
    return rng.uniform(-1, 1) * 10.0 ** rng.randint(-12, 12)


def _results(rng: random.Random, world: int, value: Callable[[random.Random], float], *, counted: bool = True,
             nonfinite: tuple[int, ...] = ()) -> list[StepResult]:
    lr, norm = rng.random(), rng.random() * 10
    out = []
    for rank in range(world):
        samples = rng.randint(1, 9)
        totals = LossTotals(loss_sum=value(rng), samples=samples, count=float(rng.randint(1, 500)) if counted else 0.0,
                            counted=counted, items=float(rng.randint(1, 5000)))
        out.append(StepResult(totals=totals, grad_norm=norm, lr=lr, skipped=bool(nonfinite), loss_scale=1.0,
                              compute_seconds=rng.random(), rank=rank, data_seconds=abs(value(rng)),
                              bytes_sent={"reduce_scatter": rng.randint(0, 10 ** 9), "all_gather": rng.randint(0, 99)},
                              nonfinite_loss_ranks=nonfinite, nonfinite_grad_ranks=nonfinite[:1]))
    return out


def _tree_combine(rng: random.Random, replies: list[CombinedStep]) -> CombinedStep:
    """``replies`` combined as a random relay tree would: split into random groups, each
    combined (recursively) in a random order."""
    if len(replies) == 1:
        return replies[0]
    cuts = sorted(rng.sample(range(1, len(replies)), rng.randint(1, min(15, len(replies) - 1))))
    groups = [replies[a:b] for a, b in zip([0, *cuts], [*cuts, len(replies)])]
    rng.shuffle(groups)  # replies reach a relay in any order
    return combine_steps(_tree_combine(rng, g) for g in groups)


def _failure(rank: int, at: float) -> RankFailure:
    return RankFailure(rank=rank, node=f"node-{rank // 8}", at=at,
                       detail=FailureDetail(type="RuntimeError", message=f"boom on {rank}", rank=rank))


def test_exact_sums_do_not_depend_on_order() -> None:
    values = [1e16, 1.0, -1e16, 0.1, 0.2, 0.3, 1e-300]
    forward = combine_sum(values)
    backward = combine_sum(values[::-1])
    assert forward == backward
    assert forward.value == math.fsum(values)
    assert sum(values) != math.fsum(values)  # the naive sum rounds 1.0 away
    assert ExactSum.of(*values).value == math.fsum(values)
    assert ExactSum.of(0.5, 0.25) == ExactSum.of(0.75) == ExactSum.of(1.0, -0.25)
    assert ExactSum().value == 0.0 and ExactSum.of() == ExactSum()
    assert ExactSum.of(5e-324).value == 5e-324 and ExactSum.of(2.5e-308, 1e-310).value == 2.5e-308 + 1e-310


def combine_sum(values: list[float]) -> ExactSum:
    out = ExactSum()
    for v in values:
        out = out + ExactSum.of(v)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_exact_sums_of_wild_floats_are_the_correctly_rounded_sum_in_any_grouping(seed: int) -> None:
    rng = random.Random(seed)
    values = [_wild(rng) for _ in range(200)]
    whole = ExactSum.of(*values)
    assert whole.value == math.fsum(values)
    for _ in range(5):
        rng.shuffle(values)
        cut = rng.randrange(len(values))
        assert ExactSum.of(*values[:cut]) + ExactSum.of(*values[cut:]) == whole


def test_non_finite_terms_sum_as_floats_do() -> None:
    inf, nan = math.inf, math.nan
    assert ExactSum.of(1.0, inf).value == inf
    assert ExactSum.of(-inf, 2.0).value == -inf
    assert math.isnan((ExactSum.of(inf) + ExactSum.of(-inf)).value)
    assert math.isnan(ExactSum.of(1.0, nan).value)
    assert ExactSum.of(sys.float_info.max, sys.float_info.max).value == inf  # past the float range, as a float sum
    assert (ExactSum.of(sys.float_info.max, sys.float_info.max) + ExactSum.of(-sys.float_info.max)).value \
        == sys.float_info.max  # but exactly: what was past it comes back


@pytest.mark.parametrize("seed", range(25))
def test_any_tree_shape_gives_what_combining_every_reply_at_once_gives(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 2, 8, 9, 64, rng.randint(1, 300)])
    results = _results(rng, world, rng.choice([_dyadic, _wild]), counted=rng.random() < 0.5)
    replies = [CombinedStep.of(r) for r in results]
    failed = rng.sample(range(world), rng.randint(0, min(3, world)))
    for rank in failed:
        replies[rank] = CombinedStep.failed(_failure(rank, at=rng.choice([1.0, 2.0])))
    whole = combine_steps(replies)
    assert whole.ranks.covers(world) and len(whole.ranks) == world
    for _ in range(4):
        assert _tree_combine(rng, replies) == whole
    if failed:  # the earliest failure, the lower rank on a tie
        assert whole.failure == min((replies[r].failure for r in failed), key=lambda f: (f.at, f.rank))
    else:
        assert whole.failure is None


@pytest.mark.parametrize("seed", range(15))
def test_step_metrics_from_a_tree_s_reply_are_those_of_the_flat_combination(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 8, 9, 64, 200])
    nonfinite = rng.choice([(), (3,), (0, 5)])
    results = _results(rng, world, _dyadic, counted=rng.random() < 0.5, nonfinite=nonfinite)
    kw = dict(step=seed + 1, samples=sum(r.totals.samples for r in results), seconds=0.25, sent_ahead=bool(seed % 2))
    reply = _tree_combine(rng, [CombinedStep.of(r) for r in results])
    flat = StepMetrics.of(combine_steps(CombinedStep.of(r) for r in results), **kw)
    assert StepMetrics.of(reply, **kw) == flat
    # the figures the driver once summed from the list of replies, here exact (dyadic losses)
    counted = results[0].totals.counted
    total = sum(r.totals.count if counted else r.totals.samples for r in results)
    assert flat["loss"] == sum(r.totals.loss_sum for r in results) / total
    assert flat["grad_norm"] == results[0].grad_norm and ("count" in flat) == counted
    assert flat["bytes_sent"] == sum(sum(r.bytes_sent.values()) for r in results)
    assert flat["owner_compute_seconds"] == max(r.compute_seconds for r in results)
    assert (flat.get("nonfinite_loss_ranks") or []) == sorted(set(nonfinite))
    # data wait: the slowest owner's, and in all
    assert reply.data_seconds == max(r.data_seconds for r in results)
    assert reply.data_seconds_sum.value == math.fsum(r.data_seconds for r in results)


def test_with_floats_that_round_the_metrics_are_the_exact_sums_rounded_once() -> None:
    rng = random.Random(7)
    results = _results(rng, 300, _wild)
    reply = _tree_combine(rng, [CombinedStep.of(r) for r in results])
    kw = dict(step=1, samples=sum(r.totals.samples for r in results), seconds=1.0, sent_ahead=False)
    combined = StepMetrics.of(reply, **kw)
    exact = math.fsum(r.totals.loss_sum for r in results) / math.fsum(r.totals.count for r in results)
    assert combined["loss"] == exact
    rounding = sum(r.totals.loss_sum for r in results) / sum(r.totals.count for r in results)
    assert combined["loss"] == pytest.approx(rounding, rel=1e-9)  # a running float sum rounds at every addition


def test_evaluation_totals_combine_to_today_s_figures() -> None:
    rng = random.Random(3)
    totals = [LossTotals(loss_sum=_dyadic(rng), samples=rng.randint(0, 5), count=float(rng.randint(0, 9)),
                         counted=True, items=float(rng.randint(0, 99))) for _ in range(40)]
    combined = sum((CombinedTotals.of(t, rank=i) for i, t in enumerate(totals)), CombinedTotals())
    today = combine(totals)
    assert (combined.loss, combined.samples, combined.items.value, combined.count.value) == \
        (today["loss"], today["samples"], today["items"], today["count"])
    assert math.isnan(CombinedTotals().loss)


@pytest.mark.parametrize("counted", [True, False])
def test_evaluations_combine_in_any_tree_to_the_direct_path_s_figures(counted: bool) -> None:
    rng = random.Random(11)
    results = [EvaluateResult(totals=r.totals, rank=r.rank) for r in _results(rng, 64, _dyadic, counted=counted)]
    flat = combine_evaluations(CombinedEvaluation.of(r) for r in results)
    replies = [CombinedEvaluation.of(r) for r in results]
    for _ in range(5):  # any grouping and order: a random tree of random groups
        order = replies[:]
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(order)), 7))
        groups = [combine_evaluations(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)])]
        assert combine_evaluations(groups) == flat
    assert flat.ranks.covers(64) and flat.failure is None
    assert flat.totals.figures() == combine([r.totals for r in results])  # dyadic: float sums are exact
    late, early = _failure(9, at=2.0), _failure(40, at=1.0)
    failed = combine_evaluations([*replies[:9], CombinedEvaluation.failed(late), *replies[10:40],
                                  CombinedEvaluation.failed(early), *replies[41:]])
    assert failed.failure == early and failed.ranks.covers(64)
    assert failed.totals.samples == flat.totals.samples - results[9].totals.samples - results[40].totals.samples


def test_per_rank_replies_are_kept_in_rank_order_whatever_the_grouping() -> None:
    rng = random.Random(4)
    replies = [CombinedReplies.of(r, f"reply {r}".encode()) for r in range(32)]
    late, early = _failure(20, at=5.0), _failure(8, at=1.0)
    replies[20:24] = [CombinedReplies.failed(ranks=RankSpans.of_ranks(range(20, 24)), failure=late)]
    replies[8] = CombinedReplies.failed(ranks=RankSpans.of(8), failure=early)
    rng.shuffle(replies)
    cuts = sorted(rng.sample(range(1, len(replies)), 5))
    groups = [combine_replies(replies[a:b]) for a, b in zip([0, *cuts], [*cuts, len(replies)])]
    rng.shuffle(groups)
    out = combine_replies(groups)
    assert [o.rank for o in out.replies] == list(range(32)) and out.ranks.covers(32)
    assert [o.rank for o in out.replies if o.failure is late] == [20, 21, 22, 23]
    assert out.failure == early
    assert [o.reply for o in out.replies if o.failure is None][:2] == [b"reply 0", b"reply 1"]
    with pytest.raises(RelayError, match="combined twice"):
        out + CombinedReplies.of(3, b"again")


def test_a_figure_every_rank_shares_is_checked_not_summed() -> None:
    rng = random.Random(0)
    results = _results(rng, 8, _dyadic)
    results[5] = StepResult(**{**results[5].__dict__, "lr": results[5].lr * 2})
    with pytest.raises(ReplyMismatchError, match=r"lr differs between rank 0 .* and rank 5") as caught:
        combine_steps(CombinedStep.of(r) for r in results)
    assert caught.value.ranks == (0, 5) and caught.value.field == "the step's lr"
    # in a tree, the two ranks named are the lowest of each side where they meet
    left = combine_steps(CombinedStep.of(r) for r in results[:4])
    with pytest.raises(ReplyMismatchError, match=r"rank 0 .* and rank 5"):
        left + CombinedStep.of(results[5])
    with pytest.raises(ReplyMismatchError, match=r"rank 5 .* and rank 6"):
        combine_steps(CombinedStep.of(r) for r in results[5:])


def test_whether_the_loss_was_counted_is_voted_only_by_ranks_with_samples() -> None:
    counted = LossTotals(loss_sum=3.0, samples=2, count=6.0, counted=True, items=6.0)
    empty = LossTotals(loss_sum=0.0, samples=0, count=0.0, counted=False, items=0.0)  # never called loss_fn
    mean = LossTotals(loss_sum=1.0, samples=2, count=0.0, counted=False, items=2.0)
    both = CombinedTotals.of(empty, rank=0) + CombinedTotals.of(counted, rank=1)
    assert both.is_counted and both.loss == 0.5 and both.counted.rank == 1
    with pytest.raises(ReplyMismatchError, match="whether loss_fn counted its items differs between rank 1"):
        both + CombinedTotals.of(mean, rank=2)


def test_a_rank_combined_twice_is_refused_and_spans_merge() -> None:
    one = CombinedStep.failed(_failure(3, at=1.0))
    with pytest.raises(RelayError, match="rank 3's reply is combined twice"):
        one + one
    spans = RankSpans.of(0) + RankSpans.of(2) + RankSpans.of(1) + RankSpans.of(5)
    assert spans.spans == ((0, 3), (5, 6)) and len(spans) == 4 and not spans.covers(6)
    assert RankSpans.of_ranks([5, 0, 2, 1]) == spans
    with pytest.raises(RelayError, match="rank 2's reply is combined twice"):
        RankSpans.of_ranks([2, 3, 2])


def test_metrics_of_a_failed_or_empty_reply_are_refused() -> None:
    rng = random.Random(1)
    ok = CombinedStep.of(_results(rng, 1, _dyadic)[0])
    failed = ok + CombinedStep.failed(_failure(1, at=5.0))
    assert failed.failure is not None and (failed.failure.rank, failed.failure.node) == (1, "node-0")
    for reply in (failed, CombinedStep()):
        with pytest.raises(RelayError, match="metrics are a completed step's"):
            StepMetrics.of(reply, step=1, samples=1, seconds=1.0, sent_ahead=False)
