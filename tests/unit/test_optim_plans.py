"""Pure planning for the user's optimizers (milliseconds): groups split by optimizer, whole-tensor
assignments and pieces, the state table, and where whole-tensor state moves on a resize."""

from __future__ import annotations

import itertools

import pytest

from zero_ray.core.whole_tensor_assignees import plan_whole_tensors, whole_pieces
from zero_ray.core.group_policy import plan_groups
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.optim_state import bucket_kinds, merge_tables, table_by_name, table_from_names
from zero_ray.core.reshard_plan import plan_whole_moves
from zero_ray.core.stages import stage_plan
from zero_ray.core.stage3_units import UnitPlan, UnitSpec

SHAPES = [(8, 4), (4,), (4, 6), (6,), (6, 3), (3,)]


def layout(world_size: int, groups: list[list[int]] | None = None) -> FlatLayout:
    specs = [(f"p{i}", s, "float32") for i, s in enumerate(SHAPES)]
    return FlatLayout.build(specs, world_size=world_size, groups=groups or [[4, 3, 2], [1, 0], [5]])


def test_groups_are_split_by_the_optimizer_that_steps_them() -> None:
    of = [0, 1, 0, 1, 0, None]  # matrices by optimizer 0, vectors by optimizer 1, p5 by none
    specs = plan_groups(stage_plan(2), shapes=SHAPES, trainable=[True] * 5 + [False], bucket_numel=1000,
                        optimizer_of=of)
    assert [(g.params, g.optimizer, g.policy.trainable) for g in specs] == \
           [((4, 2, 0), 0, True), ((3, 1), 1, True), ((5,), None, False)]
    units = UnitPlan(units=(UnitSpec(index=0, path="", params=(0, 1, 2, 3), numel=68, parent=None, depth=0),
                            UnitSpec(index=1, path="b", params=(4, 5), numel=21, parent=0, depth=1)),
                     persistent=(), num_params=6)
    specs = plan_groups(stage_plan(3), shapes=SHAPES, trainable=[True] * 5 + [False], bucket_numel=1000,
                        units=units, optimizer_of=of)
    assert [(g.params, g.unit, g.optimizer) for g in specs] == \
           [((0, 2), 0, 0), ((1, 3), 0, 1), ((4,), 1, 0), ((5,), 1, None)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_whole_pieces_cover_each_parameter_once(world_size: int) -> None:
    lay = layout(world_size)
    for p in range(len(SHAPES)):
        pieces = whole_pieces(lay, p)
        assert pieces[0].param_start == 0 and pieces[-1].param_end == lay.params[p].numel
        assert all(a.param_end == b.param_start for a, b in itertools.pairwise(pieces))
        bucket = lay.buckets[lay.params[p].bucket]
        for piece in pieces:
            start, _ = bucket.shard_range(piece.rank)
            assert start + piece.local_start == lay.params[p].offset + piece.param_start


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_assignments_are_balanced_and_prefer_the_owner_holding_most(world_size: int) -> None:
    lay = layout(world_size)
    params = [0, 2, 4]
    plan = plan_whole_tensors(lay, params)
    assert sorted(plan.assignee) == params
    load = [sum(lay.params[p].numel for p in plan.assigned_to(r)) for r in range(world_size)]
    total, largest = sum(lay.params[p].numel for p in params), max(lay.params[p].numel for p in params)
    assert sum(load) == total and max(load) <= total / world_size + largest
    first = max(params, key=lambda p: lay.params[p].numel)  # the largest goes where most of it already is
    held = {piece.rank: piece.numel for piece in plan.pieces[first]}
    assert plan.assignee[first] == max(held, key=lambda r: (held[r], -r))
    assert plan == plan_whole_tensors(lay, list(reversed(params)))  # deterministic on every rank


def test_the_state_table_merges_and_names_its_entries() -> None:
    lay = layout(2)
    a = {0: {"scalars": {"step": ["tensor", "float32", 3.0, False]}, "elementwise": ["exp_avg"], "whole": {}}}
    b = {"2": {"scalars": {}, "elementwise": ["exp_avg", "exp_avg_sq"], "whole": {}}}
    table = merge_tables([a, b, a])
    assert sorted(table) == [0, 2]
    assert bucket_kinds(lay, table) == [["master", "exp_avg", "exp_avg_sq"], ["master", "exp_avg"], ["master"]]
    names = [p.name for p in lay.params]
    assert table_from_names(table_by_name(table, names), {n: i for i, n in enumerate(names)}) == table


@pytest.mark.parametrize(("old", "new", "replicated"), [(2, 3, False), (3, 1, False), (2, 2, True), (1, 4, True)])
def test_whole_state_moves_from_the_old_assignee_to_the_new(old: int, new: int, replicated: bool) -> None:
    params = [0, 2, 4]
    table = {p: {"whole": {"row": {"shape": [SHAPES[p][0]], "dtype": "float32"},
                           "col": {"shape": [SHAPES[p][1]], "dtype": "float32"}}} for p in params}
    before, after = plan_whole_tensors(layout(old), params), plan_whole_tensors(layout(new), params)
    moves = plan_whole_moves(table, old_assignee=before.assignee, new_assignee=after.assignee, new_world=new,
                             replicated=replicated)
    for p in params:
        mine = [m for m in moves if m.param == p]
        assert {m.src for m in mine} == {before.assignee[p]}
        assert {(m.key, m.dst) for m in mine} == {(k, d) for k in ("row", "col")
                                                  for d in (range(new) if replicated else [after.assignee[p]])}
        assert all(m.shape == tuple(table[p]["whole"][m.key]["shape"]) for m in mine)
