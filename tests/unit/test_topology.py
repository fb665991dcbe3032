"""Topology and Mesh planning (pure, milliseconds): node-major order, groups, validation."""

from __future__ import annotations

import pytest

from zero_ray.core.topology import Topology, node_major, plan_mesh
from zero_ray.errors import ConfigError


def test_default_is_flat() -> None:
    assert Topology().flat
    assert not Topology(shard_group_size=2).flat
    assert not Topology(grad_comm="int4").flat


@pytest.mark.parametrize("kwargs", [
    {"shard_group_size": 0}, {"shard_group_size": True}, {"shard_group_size": "rack"},
    {"secondary_group_size": -1}, {"weight_comm": "int4"}, {"grad_comm": "fp8"}, {"quant_block": 3},
    {"shard_group_size": 4, "secondary_group_size": 3}, {"shard_group_size": "node", "secondary_group_size": 2},
])
def test_invalid_topologies_name_the_value(kwargs: dict) -> None:
    with pytest.raises(ConfigError) as err:
        Topology(**kwargs)
    assert repr(next(iter(kwargs.values())))[:4] in str(err.value) or "divide" in str(err.value)


def test_stage_checks() -> None:
    Topology(secondary_group_size=2, weight_comm="int8").check_stage(3)
    with pytest.raises(ConfigError, match="stage=3"):
        Topology(secondary_group_size=2).check_stage(2)
    with pytest.raises(ConfigError, match="qwZ"):
        Topology(weight_comm="int8").check_stage(1)
    Topology(shard_group_size=2, grad_comm="int4").check_stage(1)


def test_a_resize_keeps_every_group_whole() -> None:
    Topology().check_resize(4, 3)
    Topology(grad_comm="int8").check_resize(4, 3)
    Topology(shard_group_size=2).check_resize(4, 6)
    Topology(shard_group_size=2, secondary_group_size=2).check_resize(4, 2)
    Topology(shard_group_size="node").check_resize(4, 4)  # the same size: nothing moves
    for topology in (Topology(shard_group_size=2), Topology(secondary_group_size=2)):
        with pytest.raises(ConfigError, match="resize to 5 owners would break the groups of .*=2: resize to a "
                                              "multiple of 2"):
            topology.check_resize(4, 5)
    with pytest.raises(ConfigError, match="shard_group_size='node' is not supported"):
        Topology(shard_group_size="node").check_resize(4, 6)


def test_node_major_orders_nodes_by_lowest_rank() -> None:
    # Ray spread the owners alternately: positions put each node's owners together.
    assert node_major(["b", "a", "b", "a"]) == (0, 2, 1, 3)
    assert node_major(["x", "x", "y", "y"]) == (0, 1, 2, 3)


def test_shard_groups_by_node() -> None:
    nodes = ["b", "a", "b", "a"]
    mesh = plan_mesh(Topology(shard_group_size="node"), nodes)
    assert (mesh.shard, mesh.replicas, mesh.inner, mesh.outer) == (2, 2, 2, 2)
    assert mesh.shard_members(0) == (0, 2) and mesh.shard_members(3) == (1, 3)
    assert mesh.replica_members(0) == (0, 1) and mesh.replica_members(2) == (2, 3)
    for r in range(4):  # a shard group is one node; its replicas are on the other
        assert all(mesh.same_node(r, m) for m in mesh.shard_members(r))
        assert [mesh.same_node(r, m) for m in mesh.replica_members(r)].count(True) == 1


def test_integer_groups_on_one_node() -> None:
    mesh = plan_mesh(Topology(shard_group_size=2), ["n"] * 4)
    assert mesh.shard_members(1) == (0, 1) and mesh.shard_members(2) == (2, 3)
    assert mesh.replica_members(1) == (1, 3)
    assert mesh.node_count == 1


def test_the_first_shard_group_writes_the_checkpoint_as_a_flat_run_of_its_size() -> None:
    mesh = plan_mesh(Topology(shard_group_size=2), ["n"] * 4)
    roles = [mesh.save_role(r) for r in range(4)]
    assert [(r.writes, r.rank, r.world_size) for r in roles] == [(True, 0, 2), (True, 1, 2), (False, 0, 2),
                                                                   (False, 1, 2)]
    # Ray spread the owners alternately: the first node's owners (world ranks 0 and 2) write, as 0 and 1 of 2.
    mesh = plan_mesh(Topology(shard_group_size="node"), ["b", "a", "b", "a"])
    assert [(mesh.save_role(r).writes, mesh.save_role(r).rank) for r in range(4)] == [(True, 0), (False, 0),
                                                                                       (True, 1), (False, 1)]
    flat = plan_mesh(Topology(), ["n"] * 3)  # flat: every rank writes its own file, as today
    assert [(flat.save_role(r).writes, flat.save_role(r).rank, flat.save_role(r).world_size) for r in range(3)] == \
        [(True, 0, 3), (True, 1, 3), (True, 2, 3)]


def test_hpz_without_shard_groups() -> None:
    mesh = plan_mesh(Topology(secondary_group_size="node", weight_comm="int8", grad_comm="int4"), ["a", "a", "b", "b"])
    assert (mesh.shard, mesh.replicas, mesh.secondary, mesh.inner, mesh.outer) == (4, 1, 2, 2, 2)
    assert mesh.secondary_members(3) == (2, 3)
    assert mesh.inner_members(1) == (0, 1) and mesh.outer_members(1) == (1, 3)


def test_quantized_gradients_use_the_node_as_inner_group() -> None:
    mesh = plan_mesh(Topology(grad_comm="int8"), ["a", "a", "b", "b"])
    assert (mesh.inner, mesh.outer) == (2, 2)
    assert plan_mesh(Topology(), ["a", "a", "b", "b"]).inner == 4


def test_node_sizes_must_agree_for_node_groups() -> None:
    with pytest.raises(ConfigError, match=r"\[1, 2\] per node"):
        plan_mesh(Topology(shard_group_size="node"), ["a", "a", "b"])


def test_group_size_must_divide_world() -> None:
    with pytest.raises(ConfigError, match="does not divide world_size=6"):
        plan_mesh(Topology(shard_group_size=4), ["n"] * 6)
    with pytest.raises(ConfigError, match="secondary_group_size=4 does not divide world_size=6"):
        plan_mesh(Topology(secondary_group_size=4), ["n"] * 6)
    with pytest.raises(ConfigError, match="stage 0"):
        plan_mesh(Topology(shard_group_size=1), ["n"] * 2)


def test_zero_config_validates_its_topology() -> None:
    import zero_ray as zr

    assert zr.ZeroConfig().topology == zr.Topology()
    zr.ZeroConfig(stage=3, world_size=4, topology=zr.Topology(shard_group_size=2, secondary_group_size=2))
    with pytest.raises(ConfigError, match="stage=3"):
        zr.ZeroConfig(stage=2, world_size=4, topology=zr.Topology(secondary_group_size=2))
    with pytest.raises(ConfigError, match="does not divide world_size=4"):
        zr.ZeroConfig(stage=2, world_size=4, topology=zr.Topology(shard_group_size=3))
    with pytest.raises(ConfigError, match="must be a zr.Topology"):
        zr.ZeroConfig(topology={"shard_group_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="redundancy='peer'"):
        zr.ZeroConfig(world_size=4, topology=zr.Topology(shard_group_size=2),
                      elastic=zr.ElasticConfig(redundancy="peer"))


def test_resize_multiple_is_every_integer_group_size() -> None:
    assert Topology().resize_multiple() == 1
    assert Topology(grad_comm="int4").resize_multiple() == 1
    assert Topology(shard_group_size=4, secondary_group_size=2).resize_multiple() == 4
    assert Topology(secondary_group_size=3).resize_multiple() == 3
    assert Topology(shard_group_size="node").resize_multiple() is None
