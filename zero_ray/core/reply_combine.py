"""Step replies combined on their way up the relay tree (issue 44), exactly and in any order.

A relay combines its children's replies (owners' ``StepResult``, or other relays' combined
replies) into one ``CombinedStep``; the driver reads the step's figures from the one it gets.
For that to be the figures the driver reads from every owner's reply today, whatever the tree,
combining is associative and commutative, exactly:

- sums of floats (loss sums, counts, items, data waits) are kept exact (``ExactSum``), so no
  grouping rounds differently from another; they are rounded once, when read;
- figures every rank reports alike (grad norm, lr, skip, loss scale, refusal; whether the loss
  was counted, among ranks that had samples) are checked equal, not summed: a mismatch is a
  ``ReplyMismatchError`` naming both ranks;
- maxima (compute, data wait) and integer sums (samples, bytes per collective kind) are exact
  already; the non-finite ranks are a union;
- the first failure is kept: the earliest seen, the lower rank on a tie, with its rank and node.

An evaluation's replies combine the same way (``CombinedEvaluation``: loss totals and the first
failure). A report's are not combined at all (``CombinedReplies``): every rank's reply is kept,
unparsed, in rank order, since a user asks for each rank's figure.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from zero_ray.core.records import EvaluateResult, LossTotals, StepResult
from zero_ray.errors import ConfigError, FailureDetail, RelayError, ReplyMismatchError

T = TypeVar("T")


_UNIT = 2 ** 1074  # every finite float is a whole number of 2 ** -1074 (the least subnormal)


@dataclass(frozen=True, kw_only=True)
class ExactSum:
    """A sum of floats held exactly: ``units`` is the finite terms' sum in units of 2 ** -1074,
    which every finite float is a whole number of, so integer addition keeps it exact (and one
    sum has one form: equal sums are equal records); the infinite and NaN terms are flags, as
    float addition would have them."""

    units: int = 0
    pos_inf: bool = False
    neg_inf: bool = False
    nan: bool = False

    @classmethod
    def of(cls, *values: float) -> ExactSum:
        """The sum of ``values``."""
        units, pos_inf, neg_inf, nan = 0, False, False, False
        for v in values:
            if math.isfinite(v):
                n, d = float(v).as_integer_ratio()  # d is a power of two, at most 2 ** 1074
                units += n * (_UNIT // d)
            elif math.isnan(v):
                nan = True
            elif v > 0:
                pos_inf = True
            else:
                neg_inf = True
        return cls(units=units, pos_inf=pos_inf, neg_inf=neg_inf, nan=nan)

    def __add__(self, other: ExactSum) -> ExactSum:
        return ExactSum(units=self.units + other.units, pos_inf=self.pos_inf or other.pos_inf,
                        neg_inf=self.neg_inf or other.neg_inf, nan=self.nan or other.nan)

    @property
    def value(self) -> float:
        """The sum as the nearest float (inf past the largest float; what float addition gives
        for infinite and NaN terms)."""
        if self.nan or (self.pos_inf and self.neg_inf):
            return math.nan
        if self.pos_inf or self.neg_inf:
            return math.inf if self.pos_inf else -math.inf
        try:
            return self.units / _UNIT  # int / int: correctly rounded
        except OverflowError:
            return math.inf if self.units > 0 else -math.inf


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@dataclass(frozen=True, kw_only=True)
class Agreed(Generic[T]):
    """A figure every rank reports alike, and the lowest rank that reported it (named when
    another rank's differs)."""

    value: T
    rank: int

    def with_(self, other: Agreed[T], what: str) -> Agreed[T]:
        """The one figure of both, or ReplyMismatchError naming both ranks."""
        if not _same(self.value, other.value):
            raise ReplyMismatchError(f"{what} differs between rank {self.rank} ({self.value!r}) and rank "
                                     f"{other.rank} ({other.value!r}): every rank reports the same for a step, so "
                                     "these ranks did not run the same step; look for an owner whose code, config "
                                     "or state differs from the others'", field=what,
                                     ranks=(self.rank, other.rank), values=(self.value, other.value))
        return self if self.rank <= other.rank else other


def _agree(a: Agreed[T] | None, b: Agreed[T] | None, what: str) -> Agreed[T] | None:
    return b if a is None else a if b is None else a.with_(b, what)


@dataclass(frozen=True, kw_only=True)
class CombinedTotals:
    """Several ranks' ``LossTotals`` (a step's or an evaluation's), combined."""

    loss_sum: ExactSum = ExactSum()
    samples: int = 0
    count: ExactSum = ExactSum()
    items: ExactSum = ExactSum()
    # Whether loss_fn returned (loss_sum, count): the same on every rank that had samples (one
    # that had none never called loss_fn); None while no such rank is in.
    counted: Agreed[bool] | None = None

    @classmethod
    def of(cls, totals: LossTotals, *, rank: int) -> CombinedTotals:
        """One rank's totals."""
        return cls(loss_sum=ExactSum.of(totals.loss_sum), samples=totals.samples, count=ExactSum.of(totals.count),
                   items=ExactSum.of(totals.items),
                   counted=Agreed(value=totals.counted, rank=rank) if totals.samples > 0 else None)

    def __add__(self, other: CombinedTotals) -> CombinedTotals:
        return CombinedTotals(loss_sum=self.loss_sum + other.loss_sum, samples=self.samples + other.samples,
                              count=self.count + other.count, items=self.items + other.items,
                              counted=_agree(self.counted, other.counted, "whether loss_fn counted its items"))

    @property
    def is_counted(self) -> bool:
        return self.counted is not None and self.counted.value

    @property
    def loss(self) -> float:
        """The mean loss: over items when counted, else over samples (NaN over none), as
        ``control.handlers.combine`` computes it."""
        if self.is_counted:
            count = self.count.value
            return self.loss_sum.value / count if count else math.nan
        return self.loss_sum.value / self.samples if self.samples else math.nan

    def figures(self) -> dict[str, float]:
        """``loss``, ``samples``, ``items`` and, when counted, ``count``: what an evaluation
        returns (``ZeroTrainer.evaluate``), the same whichever path its replies took."""
        out = {"samples": self.samples, "items": self.items.value}
        if self.is_counted:
            out["count"] = self.count.value
        out["loss"] = self.loss
        return out


@dataclass(frozen=True, kw_only=True)
class StepAgreement:
    """What every rank reports alike about a step: the norm is the global one (each rank's
    squares are all-reduced before the owner reports it), the rest the run's."""

    grad_norm: float
    lr: float
    skipped: bool
    loss_scale: float
    refused: bool


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """A rank's failed call, as the relay that called it saw it: ``at`` is when (Unix time on
    that relay's clock: comparable within a node, across nodes up to clock skew)."""

    rank: int
    node: str
    detail: FailureDetail
    at: float

    def __post_init__(self) -> None:
        if self.rank < 0 or not math.isfinite(self.at):
            raise ConfigError(f"RankFailure(rank={self.rank}, at={self.at}) needs a rank >= 0 and a finite time")

    def _order(self) -> tuple[float, int]:
        return self.at, self.rank


@dataclass(frozen=True, kw_only=True)
class RankSpans:
    """A set of ranks as sorted, disjoint, non-adjacent ``(start, stop)`` ranges: the ranks whose
    replies (results or failures) a combined reply holds."""

    spans: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, rank: int) -> RankSpans:
        return cls(spans=((rank, rank + 1),))

    @classmethod
    def of_ranks(cls, ranks: Iterable[int]) -> RankSpans:
        """These ranks (RelayError for one named twice, as combining its replies twice would be)."""
        out = cls()
        for rank in ranks:
            out = out + cls.of(rank)
        return out

    def __add__(self, other: RankSpans) -> RankSpans:
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(self.spans + other.spans):
            if merged and start < merged[-1][1]:
                raise RelayError(f"rank {start}'s reply is combined twice: a relay tree calls each rank once; "
                                 "combine the replies of disjoint subtrees only")
            if merged and start == merged[-1][1]:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        return RankSpans(spans=tuple(merged))

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.spans)

    def covers(self, world_size: int) -> bool:
        """Whether these are exactly ranks 0..world_size-1."""
        return self.spans == (((0, world_size),) if world_size else ())


@dataclass(frozen=True, kw_only=True)
class CombinedStep:
    """Several ranks' replies to one step: their results combined, and the first failure."""

    ranks: RankSpans = RankSpans()
    totals: CombinedTotals = CombinedTotals()
    agreed: Agreed[StepAgreement] | None = None  # None while no rank's result is in
    compute_seconds: float = 0.0  # the slowest rank's
    data_seconds: float = 0.0  # the longest wait for a piece of the batch
    data_seconds_sum: ExactSum = ExactSum()
    bytes_sent: tuple[tuple[str, int], ...] = ()  # per collective kind, by kind
    nonfinite_loss_ranks: tuple[int, ...] = ()
    nonfinite_grad_ranks: tuple[int, ...] = ()
    failure: RankFailure | None = None

    @classmethod
    def of(cls, result: StepResult) -> CombinedStep:
        """One owner's reply."""
        r = result.rank
        agreed = StepAgreement(grad_norm=result.grad_norm, lr=result.lr, skipped=result.skipped,
                               loss_scale=result.loss_scale, refused=result.refused)
        return cls(ranks=RankSpans.of(r), totals=CombinedTotals.of(result.totals, rank=r),
                   agreed=Agreed(value=agreed, rank=r), compute_seconds=result.compute_seconds,
                   data_seconds=result.data_seconds, data_seconds_sum=ExactSum.of(result.data_seconds),
                   bytes_sent=tuple(sorted(result.bytes_sent.items())),
                   nonfinite_loss_ranks=tuple(sorted(set(result.nonfinite_loss_ranks))),
                   nonfinite_grad_ranks=tuple(sorted(set(result.nonfinite_grad_ranks))))

    @classmethod
    def failed(cls, failure: RankFailure) -> CombinedStep:
        """One owner's failed call."""
        return cls(ranks=RankSpans.of(failure.rank), failure=failure)

    def __add__(self, other: CombinedStep) -> CombinedStep:
        if self.agreed is not None and other.agreed is not None and self.agreed.value != other.agreed.value:
            _agree_fields(self.agreed, other.agreed)  # names the field (equal NaNs pass there)
        failures = [f for f in (self.failure, other.failure) if f is not None]
        sent = dict(self.bytes_sent)
        for kind, n in other.bytes_sent:
            sent[kind] = sent.get(kind, 0) + n
        return CombinedStep(ranks=self.ranks + other.ranks, totals=self.totals + other.totals,
                            agreed=_lower(self.agreed, other.agreed),
                            compute_seconds=max(self.compute_seconds, other.compute_seconds),
                            data_seconds=max(self.data_seconds, other.data_seconds),
                            data_seconds_sum=self.data_seconds_sum + other.data_seconds_sum,
                            bytes_sent=tuple(sorted(sent.items())),
                            nonfinite_loss_ranks=tuple(sorted({*self.nonfinite_loss_ranks, *other.nonfinite_loss_ranks})),
                            nonfinite_grad_ranks=tuple(sorted({*self.nonfinite_grad_ranks, *other.nonfinite_grad_ranks})),
                            failure=min(failures, key=RankFailure._order) if failures else None)

    @property
    def bytes_sent_total(self) -> int:
        return sum(n for _, n in self.bytes_sent)

    @property
    def nonfinite(self) -> bool:
        """Whether the step was not applied for non-finite values on some rank."""
        return bool(self.nonfinite_loss_ranks or self.nonfinite_grad_ranks)


def _agree_fields(a: Agreed[StepAgreement], b: Agreed[StepAgreement]) -> None:
    """ReplyMismatchError naming the first field on which ``a``'s and ``b``'s ranks differ."""
    for name in ("grad_norm", "lr", "skipped", "loss_scale", "refused"):
        Agreed(value=getattr(a.value, name), rank=a.rank).with_(Agreed(value=getattr(b.value, name), rank=b.rank),
                                                                 f"the step's {name}")


def _lower(a: Agreed[T] | None, b: Agreed[T] | None) -> Agreed[T] | None:
    return b if a is None else a if b is None or a.rank <= b.rank else b


@dataclass(frozen=True, kw_only=True)
class CombinedEvaluation:
    """Several ranks' replies to one evaluation: their loss totals combined (as a step's are),
    and the first failure."""

    ranks: RankSpans = RankSpans()
    totals: CombinedTotals = CombinedTotals()
    failure: RankFailure | None = None

    @classmethod
    def of(cls, result: EvaluateResult) -> CombinedEvaluation:
        """One owner's reply."""
        return cls(ranks=RankSpans.of(result.rank), totals=CombinedTotals.of(result.totals, rank=result.rank))

    @classmethod
    def failed(cls, failure: RankFailure) -> CombinedEvaluation:
        """One owner's failed call."""
        return cls(ranks=RankSpans.of(failure.rank), failure=failure)

    def __add__(self, other: CombinedEvaluation) -> CombinedEvaluation:
        failures = [f for f in (self.failure, other.failure) if f is not None]
        return CombinedEvaluation(ranks=self.ranks + other.ranks, totals=self.totals + other.totals,
                                  failure=min(failures, key=RankFailure._order) if failures else None)


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """One rank's reply to a relayed call, unparsed (``reply``: the method's reply message,
    serialized), or why its call failed."""

    rank: int
    reply: bytes = b""
    failure: RankFailure | None = None


@dataclass(frozen=True, kw_only=True)
class CombinedReplies:
    """Several ranks' replies to a relayed call whose reply is wanted per rank (a report): every
    rank's kept, in rank order, none combined."""

    ranks: RankSpans = RankSpans()
    replies: tuple[RankOutcome, ...] = ()

    @classmethod
    def of(cls, rank: int, reply: bytes) -> CombinedReplies:
        """One owner's reply."""
        return cls(ranks=RankSpans.of(rank), replies=(RankOutcome(rank=rank, reply=reply),))

    @classmethod
    def failed(cls, *, ranks: RankSpans, failure: RankFailure) -> CombinedReplies:
        """A child's failed call: each of its ranks failed with it."""
        return cls(ranks=ranks, replies=tuple(RankOutcome(rank=r, failure=failure)
                                              for start, stop in ranks.spans for r in range(start, stop)))

    def __add__(self, other: CombinedReplies) -> CombinedReplies:
        ranks = self.ranks + other.ranks  # refuses a rank twice
        return CombinedReplies(ranks=ranks, replies=tuple(heapq.merge(self.replies, other.replies,
                                                                      key=lambda o: o.rank)))

    @property
    def failure(self) -> RankFailure | None:
        """The earliest failure (the lower rank on a tie); None when every rank answered."""
        failures = [o.failure for o in self.replies if o.failure is not None]
        return min(failures, key=RankFailure._order) if failures else None


def combine_replies(replies: Iterable[CombinedReplies]) -> CombinedReplies:
    """``replies`` (of disjoint ranks) as one, every rank's in rank order."""
    out = CombinedReplies()
    for reply in replies:
        out = out + reply
    return out


def combine_evaluations(replies: Iterable[CombinedEvaluation]) -> CombinedEvaluation:
    """``replies`` combined: any grouping and order give the same record."""
    out = CombinedEvaluation()
    for reply in replies:
        out = out + reply
    return out


def combine_steps(replies: Iterable[CombinedStep]) -> CombinedStep:
    """``replies`` combined: any grouping and order give the same record."""
    out = CombinedStep()
    for reply in replies:
        out = out + reply
    return out
