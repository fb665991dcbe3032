"""Memory and communication under a Topology (pure): the paper's formula with N = the shard
group, hpZ's secondary copy, and bytes inside / across nodes; the estimator's flags."""

from __future__ import annotations

import pytest

from zero_ray.cli import main
from zero_ray.core.memory_formulas import model_state_bytes, topology_communication, topology_state_bytes
from zero_ray.errors import ConfigError


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shard_groups_are_the_formula_with_n_the_group_size(stage: int) -> None:
    got = topology_state_bytes(stage=stage, num_params=10**9 + 3, world_size=64, shard_group_size=8)
    assert got == model_state_bytes(stage=stage, num_params=10**9 + 3, world_size=8)


def test_hpz_adds_the_secondary_partition() -> None:
    got = topology_state_bytes(stage=3, num_params=1001, world_size=16, shard_group_size=16, secondary_group_size=4)
    base = model_state_bytes(stage=3, num_params=1001, world_size=16)
    assert got.secondary == 251 * 2 and got.total == base.total + 502
    with pytest.raises(ConfigError, match="stage 3"):
        topology_state_bytes(stage=2, num_params=100, world_size=4, secondary_group_size=2)
    with pytest.raises(ConfigError, match="does not divide"):
        topology_state_bytes(stage=3, num_params=100, world_size=6, shard_group_size=4)


def test_flat_on_one_node_sends_nothing_across() -> None:
    got = topology_communication(stage=3, num_params=1000, world_size=8, node_size=8)
    assert got.cross == 0 and got.inside == pytest.approx(3 * 7 / 8 * 1000 * 2)


def test_zero_plus_plus_cross_node_volume_is_about_a_quarter_of_flat() -> None:
    """ZeRO++ (Wang et al. 2023) reports 3 Psi -> 0.75 Psi across nodes."""
    psi, n, node = 10**9, 64, 8
    flat = topology_communication(stage=3, num_params=psi, world_size=n, node_size=node)
    zpp = topology_communication(stage=3, num_params=psi, world_size=n, node_size=node, secondary_group_size=node,
                                 weight_comm="int8", grad_comm="int4")
    assert 0.2 < zpp.cross / flat.cross < 0.3
    hpz = topology_communication(stage=3, num_params=psi, world_size=n, node_size=node, secondary_group_size=node)
    assert hpz.cross == pytest.approx(flat.cross * 2 / 3)  # backward's gather no longer crosses


def test_shard_groups_of_a_node_send_only_gradient_shards_across() -> None:
    psi = 8000
    got = topology_communication(stage=3, num_params=psi, world_size=16, node_size=8, shard_group_size=8,
                                 param_bytes=4, grad_bytes=4)
    assert got.cross == pytest.approx(2 * (2 - 1) / 2 * psi / 8 * 4)  # the shard's all-reduce over 2 nodes


def test_estimate_prints_the_topology_table(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["estimate", "--params", "7.5e9", "--world-size", "64", "--shard-group", "8", "--secondary", "8",
                   "--weight-comm", "int8", "--grad-comm", "int4"])
    out = capsys.readouterr().out
    assert status == 0
    assert "Topology at Nd = 64, 8 owners per node (8 nodes)" in out
    row = next(line for line in out.splitlines() if line.startswith("3 P_os+g+p") and "x" in line.split()[-1])
    # the formula with N = 8 plus hpZ's copy: 16 * 7.5e9 / 8 + 2 * 7.5e9 / 8 = 16.875 GB
    assert "16.88" in row


def test_estimate_refuses_a_node_size_that_does_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["estimate", "--params", "1e9", "--world-size", "12", "--node-size", "8"])
    assert status == 2 and "does not divide" in capsys.readouterr().err
