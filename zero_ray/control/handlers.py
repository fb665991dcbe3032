"""What the control servers dispatch to, in plain Python.

A handler is any object with the methods of :class:`OwnerHandler` or
:class:`CoordinatorHandler`; it takes and returns the frozen dataclasses below
and never sees protobuf or gRPC. The servicers in :mod:`zero_ray.control.server`
translate in both directions, and the clients in :mod:`zero_ray.control.client`
return the same dataclasses, so both ends of a call share one vocabulary.

The records' fields are their messages' (protos/zero_ray/v1): codegen writes them to
``zero_ray/core/records.py`` (relay.proto's: ``relay_records.py``) and :mod:`zero_ray.control.conversion` converts by field name, so a new
field is written in the .proto and where it is computed. The records that check their values
(``Piece``, ``StepArgs``, ``EvaluateArgs``) subclass the generated ones here.

Threading: methods are called on the server's thread pool, several at a time
(``abort`` arrives while ``step`` is still running, ``heartbeat`` every interval
throughout), so they must be thread-safe, and every method but ``step``, ``evaluate``,
``save``, ``load``, the membership operations (``setup``, ``reform``, ``reshard``,
``rebuild``, ``snapshots``) and ``checkpoint`` should return promptly.

Errors: raise, and the caller gets a gRPC status whose code the table below gives, with a
``FailureDetail`` (the exception's type, message, cause and traceback, and the owner's rank and
phase from ``failure_context``) beside it; the typed clients raise it as
:class:`~zero_ray.errors.RemoteFailure`:

======================================  ======================
raised by the handler                   status code
======================================  ======================
``ValueError`` (incl. ``ConfigError``)  ``INVALID_ARGUMENT``
``FileNotFoundError``                   ``NOT_FOUND``
``CollectiveError``, ``OwnerError``     ``ABORTED`` (retry the step at a higher level)
``TimeoutError``                        ``DEADLINE_EXCEEDED``
``NotImplementedError``                 ``UNIMPLEMENTED``
any other ``ZeroRayError``              ``FAILED_PRECONDITION``
anything else                           ``INTERNAL`` (and logged with its traceback)
======================================  ======================
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import itertools
import math
import operator
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from zero_ray.core import records as _records
from zero_ray.core import relay_records as _relay_records
# The records whose fields are their messages' alone; the others below check their values.
from zero_ray.core.records import (
    CheckpointResult,
    CollectiveEvent,
    EvaluateResult,
    FailureDetailRecord,
    Flight,
    Heartbeat,
    JobStatus,
    LoadResult,
    LossTotals,
    MetricsEvent,
    ModelLayout,
    OwnerStats,
    OwnerStatus,
    ParamInfo,
    RankStatus,
    ResizeResult,
    SaveResult,
    SetupResult,
    StepResult,
)
from zero_ray.core.relay_records import (
    ExactSumValue,
    FailedRank,
    HostedRelay,
    HostRelaysResult,
    RankSpan,
    RankReply,
    RelayChildSeat,
    StepAgreed,
    SubtreeEvaluation,
    SubtreeReplies,
    SubtreeStep,
    SubtreeTotals,
)
from zero_ray.errors import ConfigError

__all__ = [
    "CheckpointResult", "CollectiveEvent", "CoordinatorHandler", "EvaluateArgs", "EvaluateResult", "ExactSumValue",
    "FailedRank", "FailureContext", "FailureDetailRecord", "Flight", "Heartbeat", "HostedRelay", "HostRelaysArgs",
    "HostRelaysResult", "RelayChildSeat",
    "JobStatus", "LoadResult", "LossTotals", "MetricsEvent", "ModelLayout", "OwnerHandler", "OwnerStats",
    "OwnerStatus", "ParamInfo", "Piece", "Plain", "RankReply", "RankSpan", "RankStatus", "RelayCallArgs", "RelayEvaluateArgs",
    "RelayStepArgs", "FORWARDED_METHODS", "SubtreeReplies",
    "ResizeResult", "SavePhase", "SaveResult", "SetupResult", "StepAgreed", "StepArgs", "StepResult", "SubtreeEvaluation",
    "SubtreeStep", "SubtreeTotals", "combine",
]

# Plain data: what a JSON document holds (dicts keyed by str or int, lists, numbers, str, None).
Plain = Any


def _non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"{name}={value} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class Piece(_records.Piece):
    """An owner's piece of a global batch: a key under which the driver staged it on the owner
    (through Ray's object store), or indices into a dataset the owner holds."""

    def __post_init__(self) -> None:
        if bool(self.batch_key) == bool(self.dataset):
            raise ConfigError(f"a piece names a staged batch or a dataset, exactly one: batch_key={self.batch_key!r}, "
                              f"dataset={self.dataset!r}")
        if self.batch_key and self.indices:
            raise ConfigError("indices belong to a dataset piece, not a staged batch")
        if any(i < 0 for i in self.indices):
            raise ConfigError("dataset indices must be >= 0")


def combine(totals: Sequence[LossTotals]) -> dict[str, float]:
    """The global figures of several owners' totals: ``loss`` (the mean over items when
    counted, else over samples), ``samples``, ``items`` and, when counted, ``count``."""
    samples = sum(t.samples for t in totals)
    counted = bool(totals) and totals[0].counted
    out: dict[str, float] = {"samples": samples, "items": sum(t.items for t in totals)}
    if counted:
        count = sum(t.count for t in totals)
        out["count"] = count
        out["loss"] = sum(t.loss_sum for t in totals) / count if count else float("nan")
    else:
        out["loss"] = sum(t.loss_sum for t in totals) / samples if samples else float("nan")
    return out


@dataclass(frozen=True, kw_only=True)
class StepArgs(_records.StepArgs):
    """One training step, as the driver asks an owner to run it (the fields: owner.proto's
    StepRequest)."""

    def __post_init__(self) -> None:
        _non_negative(step=self.step, global_samples=self.global_samples, generation=self.generation,
                      samples_seen=self.samples_seen)


@dataclass(frozen=True, kw_only=True)
class EvaluateArgs(_records.EvaluateArgs):
    """A forward-only pass over an owner's piece of an evaluation batch."""

    def __post_init__(self) -> None:
        _non_negative(generation=self.generation)


class _PackedRanks:
    """What a relayed call's request holds beside its common request (``_common``): the
    subtree's ranks as spans (``ranks``), and a dataset's indices packed (``counts`` per rank
    in rank order, ``indices`` concatenated), so that a request to 1,024 ranks is a few
    repeated scalar fields, not 1,024 messages. Mixed into the records of RelayStepRequest and
    RelayEvaluateRequest, whose fields these are."""

    ranks: tuple[RankSpan, ...]
    counts: tuple[int, ...]
    indices: tuple[int, ...]
    timeout_s: float
    relay: int

    @property
    def _common(self) -> Any:
        """The request every rank runs (its piece's indices empty)."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"{name}(timeout_s={self.timeout_s}) must be a finite number of seconds > 0: "
                              "the time the subtree has to answer")
        spans = [(s.start, s.stop) for s in self.ranks]
        if not spans or any(a >= b for a, b in spans) or any(b > c for (_, b), (c, _) in zip(spans, spans[1:])):
            raise ConfigError(f"{name} names the rank spans {spans}: a relayed call holds the subtree's ranks "
                              "as ascending, non-empty, non-overlapping spans, at least one")
        piece = self._common.piece
        if piece.indices:
            raise ConfigError(f"{name}'s common request's piece carries indices: a relayed call packs them in "
                              "counts and indices, one count per rank")
        ranks = sum(b - a for a, b in spans)
        if self.counts and (len(self.counts) != ranks or piece.batch_key):
            raise ConfigError(f"{name} has {len(self.counts)} counts for {ranks} ranks of "
                              f"{'a staged batch' if piece.batch_key else 'a dataset'}: a dataset's call has one "
                              "per rank, a staged batch's none")
        if sum(self.counts) != len(self.indices):
            raise ConfigError(f"{name} counts {sum(self.counts)} indices but carries {len(self.indices)}")

    @functools.cached_property
    def rank_list(self) -> tuple[int, ...]:
        """The subtree's ranks, ascending."""
        return tuple(r for s in self.ranks for r in range(s.start, s.stop))

    @functools.cached_property
    def _starts(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # each span's first rank, that rank's position in rank order, and each position's first index
        firsts = tuple(s.start for s in self.ranks)
        positions = tuple(itertools.accumulate((s.stop - s.start for s in self.ranks[:-1]), initial=0))
        return firsts, positions, tuple(itertools.accumulate(self.counts, initial=0))

    def _position(self, rank: int) -> int:
        firsts, positions, _ = self._starts
        i = bisect.bisect_right(firsts, rank) - 1
        if i < 0 or rank >= self.ranks[i].stop:
            raise ConfigError(f"rank {rank} is not among this call's ranks {[(s.start, s.stop) for s in self.ranks]}")
        return positions[i] + rank - firsts[i]

    def rank_args(self, rank: int) -> Any:
        """Rank ``rank``'s own request, as its owner is asked."""
        common = self._common
        if not self.counts:
            self._position(rank)  # checks the rank
            return common
        at = self._position(rank)
        offsets = self._starts[2]
        piece = dataclasses.replace(common.piece, indices=self.indices[offsets[at]:offsets[at + 1]])
        return dataclasses.replace(common, piece=piece)

    def for_ranks(self, ranks: Sequence[int], *, timeout_s: float, relay: int) -> Any:
        """The request for ``ranks`` (ascending, all of them this request's) of a child relay:
        a request of this one's type."""
        spans = _spans_of(ranks)
        counts: list[int] = []
        indices: list[int] = []
        if self.counts:
            offsets = self._starts[2]
            for span in spans:  # a span at a time: a node's ranks are mostly contiguous
                a = self._position(span.start)
                b = a + span.stop - span.start
                counts += self.counts[a:b]
                indices += self.indices[offsets[a]:offsets[b]]
        else:
            for span in spans:
                self._position(span.start)
        return dataclasses.replace(self, ranks=spans, counts=tuple(counts), indices=tuple(indices),  # type: ignore[type-var]
                                   timeout_s=timeout_s, relay=relay)


@dataclass(frozen=True, kw_only=True)
class RelayStepArgs(_PackedRanks, _relay_records.RelayStepArgs):
    """A step on every rank of a relay's subtree (relay.proto's RelayStepRequest): what every
    rank runs (``step``, its piece's indices empty), the subtree's ranks as spans, and a
    dataset's indices packed (``counts`` per rank in rank order, ``indices`` concatenated).
    :meth:`rank_step` is one rank's ``StepArgs``; :meth:`for_ranks` a child's request."""

    @property
    def _common(self) -> StepArgs:
        return self.step

    @classmethod
    def of(cls, step: StepArgs, *, ranks: Sequence[int], counts: Sequence[int] = (), indices: Sequence[int] = (),
           timeout_s: float, relay: int = 0) -> RelayStepArgs:
        """The request for ``ranks`` (ascending) running ``step``, each rank reading its
        ``counts`` of ``indices`` in rank order."""
        return cls(step=step, ranks=_spans_of(ranks), counts=tuple(counts), indices=tuple(indices),
                   timeout_s=timeout_s, relay=relay)

    def rank_step(self, rank: int) -> StepArgs:
        """Rank ``rank``'s own step, as its owner is asked."""
        return self.rank_args(rank)


@dataclass(frozen=True, kw_only=True)
class RelayEvaluateArgs(_PackedRanks, _relay_records.RelayEvaluateArgs):
    """An evaluation on every rank of a relay's subtree (relay.proto's RelayEvaluateRequest),
    packed as :class:`RelayStepArgs` packs a step; :meth:`rank_args` is one rank's
    ``EvaluateArgs``."""

    @property
    def _common(self) -> EvaluateArgs:
        return self.evaluate

    @classmethod
    def of(cls, evaluate: EvaluateArgs, *, ranks: Sequence[int], counts: Sequence[int] = (),
           indices: Sequence[int] = (), timeout_s: float, relay: int = 0) -> RelayEvaluateArgs:
        """The request for ``ranks`` (ascending) evaluating ``evaluate``, each rank reading its
        ``counts`` of ``indices`` in rank order."""
        return cls(evaluate=evaluate, ranks=_spans_of(ranks), counts=tuple(counts), indices=tuple(indices),
                   timeout_s=timeout_s, relay=relay)


# The PartitionOwner methods a relay forwards as they are (RelayCall): a request that is the same
# for every rank and a reply that is wanted per rank. Any other method is refused, so that the
# relay's generic path cannot reach a rank's state-changing calls; Abort is the one that changes
# state, let through because it is the same for every rank, changes nothing twice (an owner
# aborts a generation once, never an older one) and must reach thousands of survivors fast
# (RelayPlane.abort: one call per live subtree instead of one per survivor).
FORWARDED_METHODS = frozenset({"Stats", "Flight", "Status", "Abort"})


@dataclass(frozen=True, kw_only=True)
class RelayCallArgs(_relay_records.RelayCallArgs):
    """A PartitionOwner call, the same request for every rank of a relay's subtree
    (relay.proto's RelayCallRequest): the method's name, its request serialized, the ranks."""

    def __post_init__(self) -> None:
        if self.method not in FORWARDED_METHODS:
            raise ConfigError(f"RelayCallArgs(method={self.method!r}): a relay forwards only "
                              f"{sorted(FORWARDED_METHODS)}; call other methods on each owner")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"RelayCallArgs(timeout_s={self.timeout_s}) must be a finite number of seconds > 0")
        spans = [(s.start, s.stop) for s in self.ranks]
        if not spans or any(a >= b for a, b in spans) or any(b > c for (_, b), (c, _) in zip(spans, spans[1:])):
            raise ConfigError(f"RelayCallArgs names the rank spans {spans}: ascending, non-empty, non-overlapping "
                              "spans, at least one")

    @classmethod
    def of(cls, method: str, request: bytes, *, ranks: Sequence[int], timeout_s: float,
           relay: int = 0) -> RelayCallArgs:
        return cls(method=method, request=request, ranks=_spans_of(ranks), timeout_s=timeout_s, relay=relay)

    def for_ranks(self, ranks: Sequence[int], *, timeout_s: float, relay: int) -> RelayCallArgs:
        """The request for ``ranks`` (ascending, all of them this request's) of a child relay."""
        mine = {r for s in self.ranks for r in range(s.start, s.stop)}
        if not set(ranks) <= mine:
            raise ConfigError(f"ranks {sorted(set(ranks) - mine)} are not among this call's ranks")
        return dataclasses.replace(self, ranks=_spans_of(ranks), timeout_s=timeout_s, relay=relay)


def _spans_of(ranks: Sequence[int]) -> tuple[RankSpan, ...]:
    """Ascending ``ranks`` as the fewest spans."""
    if isinstance(ranks, range) and ranks.step == 1:
        return (RankSpan(start=ranks.start, stop=ranks.stop),) if ranks else ()
    # One run of consecutive ranks (a subtree's, mostly) checked at C speed: the loop below
    # cost the driver 0.8 ms a step per top relay at 8,192 owners.
    if ranks and ranks[-1] - ranks[0] == len(ranks) - 1 and all(map(operator.lt, ranks, ranks[1:])):
        return (RankSpan(start=ranks[0], stop=ranks[-1] + 1),)
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1]:
            spans[-1][1] = r + 1
        elif spans and r < spans[-1][1]:
            raise ConfigError(f"ranks {list(ranks)} must be ascending, each once")
        else:
            spans.append([r, r + 1])
    return tuple(RankSpan(start=a, stop=b) for a, b in spans)


@dataclass(frozen=True, kw_only=True)
class HostRelaysArgs(_relay_records.HostRelaysArgs):
    """The relays a process is to serve (relay.proto's HostRelaysRequest), each once."""

    def __post_init__(self) -> None:
        ids = [r.relay for r in self.relays]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"HostRelaysArgs names relays {sorted(ids)}: each relay once")
        if not (math.isfinite(self.margin_s) and self.margin_s >= 0):
            raise ConfigError(f"HostRelaysArgs(margin_s={self.margin_s}) must be a finite number of seconds >= 0")
        for hosted in self.relays:
            if not hosted.children:
                raise ConfigError(f"relay {hosted.relay} has no children: a relay calls at least one")


class SavePhase(enum.Enum):
    """The halves of an owner's save (see owner.proto)."""

    BOTH = 0
    SNAPSHOT = 1
    AWAIT = 2


@dataclass(frozen=True, kw_only=True)
class FailureContext:
    """What a failed call's FailureDetail says about the owner serving it."""

    rank: int | None = None
    phase: str = ""


@runtime_checkable
class OwnerHandler(Protocol):
    """Served as ``zero_ray.v1.PartitionOwner`` by one partition owner."""

    def step(self, args: StepArgs) -> StepResult:
        """Run one step. May block for as long as the driver's deadline allows."""
        ...

    def evaluate(self, args: EvaluateArgs) -> EvaluateResult:
        """This owner's loss on its piece, forward only (gradients off, no state change)."""
        ...

    def save(self, path: str, step: int, phase: SavePhase) -> SaveResult:
        """Write this owner's shard of the state at ``step`` under ``path`` (``phase``: snapshot
        and write in the background, wait for that write, or both)."""
        ...

    def load(self, path: str, step: int) -> LoadResult:
        """Restore this owner's shard of the state at ``step`` from ``path``."""
        ...

    def abort(self, reason: str, generation: int) -> bool:
        """Make a ``step`` of ``generation`` that is running (or about to) give up
        promptly; return whether there was one. Called while ``step`` blocks."""
        ...

    def heartbeat(self) -> Heartbeat:
        """A liveness sample; called once per interval of every open Health stream."""
        ...

    def stats(self) -> OwnerStats:
        """Memory and traffic counters."""
        ...

    def setup(self) -> SetupResult:
        """Join the group of the owner's generation and build the model state (every owner
        concurrently); may block for the driver's deadline."""
        ...

    def reform(self, generation: int) -> bool:
        """Leave the current group and join ``generation``'s; whether the state is intact."""
        ...

    def set_peers(self, backup: int, ward: int) -> None:
        """Send snapshots to rank ``backup``; keep rank ``ward``'s."""
        ...

    def snapshots(self, committed_step: int, layout_complete: bool) -> Plain:
        """The committed peer snapshots held (by rank), once every owner finished
        ``committed_step``: JSON-able records. ``layout_complete``: copies of the layout the last
        resize or restore installed count even where they were not confirmed yet."""
        ...

    def resize_info(self) -> Plain:
        """This owner's part of a resize's description (JSON-able)."""
        ...

    def reshard(self, *, old_world: int, new_world: int, generation: int, description: Plain) -> int:
        """Move this owner's state from ``old_world`` to ``new_world`` owners; bytes sent."""
        ...

    def rebuild(self, *, position: int, world_size: int, generation: int, restore: Plain | None) -> int:
        """Take ``position`` of a rebuilt ``world_size``-owner pool (``restore``: the peer
        snapshot transfer, or None for fresh state); bytes sent."""
        ...

    def status(self) -> OwnerStatus:
        """Where this owner stands."""
        ...

    def flight(self) -> Flight:
        """This owner's flight record (promptly, while a step is blocked)."""
        ...

    def close(self) -> None:
        """Leave the group and stop serving soon after replying (the process is ended next)."""
        ...

    def failure_context(self) -> FailureContext:
        """The rank and phase to report with a call that failed; called after the failure."""
        ...


@runtime_checkable
class CoordinatorHandler(Protocol):
    """Served as ``zero_ray.v1.Coordinator`` by the driver."""

    def status(self, flight: bool = False) -> JobStatus:
        """The job's current state; with ``flight``, where every owner is now."""
        ...

    def checkpoint(self, path: str | None) -> CheckpointResult:
        """Write a checkpoint now (under ``path``, or the configured directory when
        None) and return once it is complete."""
        ...

    def stop(self, reason: str) -> str:
        """Stop training after the current step; return the job's state afterwards."""
        ...

    def resize(self, world_size: int) -> ResizeResult:
        """Continue training with ``world_size`` owners."""
        ...

    def metrics(self, cancelled: threading.Event) -> Iterator[MetricsEvent]:
        """Yield one event per step as steps finish; returning ends the stream.
        ``cancelled`` is set when the caller goes away or the server stops: wait on
        it (``cancelled.wait(timeout)``) rather than sleeping, and return once set."""
        ...
