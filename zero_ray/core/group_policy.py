"""Parameter groups: how each flat buffer of a rank's model state behaves, written as data.

A rank's model state is a list of groups, one per layout bucket. A group's policy follows from
two things only: the stage's ``StagePlan`` (are parameters gathered per use, are gradients
reduced per micro-batch, is the update over the whole buffer or a shard) and the group's
contents (trainable or frozen; stage 3's small persistent parameters). The owner's code reads
these policies and never a stage number.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from zero_ray.core.stages import GradReduction, Residency, StagePlan
from zero_ray.core.stage3_units import UnitPlan
from zero_ray.errors import ConfigError


class ParamResidency(enum.Enum):
    """Where a group's parameters live between uses."""

    WHOLE = "whole"  # every rank holds all of them, always (stages 0-2; stage 3's persistent ones)
    PER_USE = "per_use"  # each rank holds a shard; gathered for a unit's forward and backward, freed after


class GradFlow(enum.Enum):
    """How a group's gradients reach the update."""

    NONE = "none"  # frozen: no gradient buffer, no reduction, no optimizer state
    ACCUMULATE = "accumulate"  # a full buffer every micro-batch adds into, reduced once per step
    PER_MICRO_BATCH = "per_micro_batch"  # staged and reduced as each backward produces it; a shard kept


@dataclass(frozen=True, kw_only=True)
class GroupPolicy:
    """What one group does at every point of a step."""

    params: ParamResidency
    grads: GradFlow
    reduction: GradReduction | None  # None when frozen
    update_whole: bool  # the update (or, frozen, the saved range) covers the whole buffer, not a shard
    gather_after_update: bool  # whole parameters updated on shards are all-gathered afterwards
    label: str = ""  # prefix of its collectives' names in the byte counters

    @property
    def trainable(self) -> bool:
        return self.grads is not GradFlow.NONE


def group_policy(plan: StagePlan, *, trainable: bool, persistent: bool = False) -> GroupPolicy:
    """The policy of a group under ``plan``. Persistent parameters (stage 3, below the
    persistence threshold) keep parameters and gradients whole on every rank: they follow the
    plan with both replicated, i.e. stage 1's."""
    if persistent:
        plan = replace(plan, gradients=Residency.REPLICATED, parameters=Residency.REPLICATED)
    grads = GradFlow.NONE
    if trainable:
        grads = GradFlow.ACCUMULATE if plan.gradients is Residency.REPLICATED else GradFlow.PER_MICRO_BATCH
    return GroupPolicy(
        params=ParamResidency.WHOLE if plan.parameters is Residency.REPLICATED else ParamResidency.PER_USE,
        grads=grads, reduction=plan.grad_reduction if trainable else None,
        update_whole=plan.updates_whole_buffer, gather_after_update=plan.gather_after_update,
        label="persistent_" if persistent else "")


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One group: its layout bucket (the same index), its parameters (layout indices, in bucket
    order), the stage-3 unit it is gathered with (None: not gathered per use), its policy and
    the optimizer that steps it."""

    index: int
    params: tuple[int, ...]
    unit: int | None
    policy: GroupPolicy
    optimizer: int | None = None  # which of the run's optimizers steps these parameters (None: none)


def size_buckets(numels: Sequence[int], members: Sequence[int], *, bucket_numel: int) -> list[list[int]]:
    """``members`` (parameter indices) in buckets of about ``bucket_numel`` elements, in reverse
    registration order (the order backward usually produces gradients in); a parameter is never
    split across buckets."""
    if bucket_numel < 1:
        raise ConfigError(f"{bucket_numel=} must be at least 1")
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in sorted(members, reverse=True):
        if current and size + numels[i] > bucket_numel:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
    if current:
        groups.append(current)
    return groups


def _by_optimizer(members: Sequence[int], optimizer_of: Sequence[int | None]) -> list[tuple[list[int], int | None]]:
    """``members`` split by the optimizer that steps them, in optimizer order (None last), so a
    group's state is all of one optimizer's kind."""
    keys = sorted({optimizer_of[i] for i in members}, key=lambda o: (o is None, o or 0))
    return [([i for i in members if optimizer_of[i] == o], o) for o in keys]


def plan_groups(plan: StagePlan, *, shapes: Sequence[tuple[int, ...]], trainable: Sequence[bool],
                bucket_numel: int, units: UnitPlan | None = None,
                optimizer_of: Sequence[int | None] | None = None) -> list[GroupSpec]:
    """Every group of a model, in layout-bucket order.

    Without units (parameters whole on every rank): trainable parameters in size buckets, then
    the frozen ones in size buckets of their own, so a bucket is all trainable or all frozen and
    the trainable buckets keep the order they would have without any frozen parameter. With
    units (stage 3): per unit its trainable parameters, then its frozen ones (gathered together,
    reduced apart); then the persistent parameters, trainable then frozen. Trainable parameters
    are further split by ``optimizer_of`` (which optimizer steps each; None: none), so each
    group's optimizer state is of one optimizer.
    """
    if len(shapes) != len(trainable):
        raise ConfigError(f"{len(shapes)} parameter shapes but {len(trainable)} trainable flags")
    of = list(optimizer_of) if optimizer_of is not None else [0 if t else None for t in trainable]
    if len(of) != len(shapes):
        raise ConfigError(f"{len(shapes)} parameter shapes but {len(of)} optimizer assignments")
    numels = [math.prod(s) for s in shapes]
    train = [i for i, t in enumerate(trainable) if t]
    frozen = [i for i, t in enumerate(trainable) if not t]
    placed: list[tuple[list[int], int | None, GroupPolicy, int | None]] = []
    if units is None:
        if plan.parameters is Residency.SHARDED:
            raise ConfigError(f"stage {plan.stage} partitions parameters: its groups need a unit plan")
        policy = group_policy(plan, trainable=True)
        for members, o in _by_optimizer(train, of):
            placed += [(g, None, policy, o) for g in size_buckets(numels, members, bucket_numel=bucket_numel)]
        policy = group_policy(plan, trainable=False)
        placed += [(g, None, policy, None) for g in size_buckets(numels, frozen, bucket_numel=bucket_numel)]
    else:
        for u in units.units:
            for members, o in _by_optimizer([i for i in u.params if trainable[i]], of):
                placed.append((members, u.index, group_policy(plan, trainable=True), o))
            members = [i for i in u.params if not trainable[i]]
            if members:
                placed.append((members, u.index, group_policy(plan, trainable=False), None))
        for members, o in _by_optimizer([i for i in units.persistent if trainable[i]], of):
            placed.append((members, None, group_policy(plan, trainable=True, persistent=True), o))
        members = [i for i in units.persistent if not trainable[i]]
        if members:
            placed.append((members, None, group_policy(plan, trainable=False, persistent=True), None))
    return [GroupSpec(index=k, params=tuple(members), unit=unit, policy=policy, optimizer=o)
            for k, (members, unit, policy, o) in enumerate(placed)]
