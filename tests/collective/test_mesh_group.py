"""Two-level collectives (SubGroup, MeshGroup) on thread ranks: results against plain sums,
identical bits on replicas, and bytes split by the peer they went to."""

from __future__ import annotations

import pytest
import torch

from thread_ranks import ThreadGroup, on_threads
from zero_ray.collective.codecs import BlockQuant, codec
from zero_ray.collective.mesh_group import MeshGroup
from zero_ray.core.topology import Topology, plan_mesh


def inputs(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(numel)
    return [torch.randn(numel, generator=g) for _ in range(n)]


@pytest.mark.parametrize("nodes", [["a", "a", "b", "b"], ["a", "b", "a", "b"]])
def test_shard_groups_reduce_scatter_then_across(nodes: list[str]) -> None:
    xs = inputs(4, 16)
    total = sum(xs)
    mesh = plan_mesh(Topology(shard_group_size=2), nodes)

    def run(g: ThreadGroup) -> tuple[int, torch.Tensor, torch.Tensor]:
        m = MeshGroup(g, mesh)
        buf = xs[g.rank].clone()
        part = m.reduce_scatter_(buf).clone()
        full = part.new_zeros(16)
        full.view(2, 8)[m.rank].copy_(part)
        m.all_gather_(full)
        return m.rank, part, full

    got = on_threads(4, run)
    for group_rank, part, full in got:
        assert torch.allclose(part, total.view(2, 8)[group_rank], atol=1e-6)
        assert torch.allclose(full, total, atol=1e-6)
    assert torch.equal(got[0][2], got[2][2]) or nodes[0] != nodes[1]  # replicas agree bit for bit


def test_bytes_split_inside_and_across_nodes() -> None:
    nodes = ["a", "a", "b", "b"]
    mesh = plan_mesh(Topology(shard_group_size="node"), nodes)

    def run(g: ThreadGroup) -> dict[int, int]:
        MeshGroup(g, mesh).reduce_scatter_(torch.ones(1024))
        return g.counters.by_peer()

    for r, peers in enumerate(on_threads(4, run)):
        inside = sum(b for p, b in peers.items() if nodes[p] == nodes[r])
        across = sum(b for p, b in peers.items() if nodes[p] != nodes[r])
        assert inside == 512 * 4  # (G-1)/G of the buffer to the node's other owner
        assert across == 2 * 256 * 4  # the 512-element shard all-reduced over 2 replicas


@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
def test_quantized_across_replicas_identical_on_replicas(name: str) -> None:
    xs = inputs(4, 4096)
    total = sum(xs)
    mesh = plan_mesh(Topology(shard_group_size=2, grad_comm=name), ["a", "a", "b", "b"])
    c = codec(name)

    def run(g: ThreadGroup) -> tuple[int, torch.Tensor]:
        m = MeshGroup(g, mesh, grad_codec=c)
        return m.rank, m.reduce_scatter_(xs[g.rank].clone()).clone()

    got = on_threads(4, run)
    assert torch.equal(got[0][1], got[2][1]) and torch.equal(got[1][1], got[3][1])
    for group_rank, part in got:
        want = total.view(2, -1)[group_rank]
        rel = float((part - want).norm() / want.norm())
        assert rel < {"int8": 0.02, "int4": 0.3, "bf16": 0.01}[name]


def test_hierarchical_reduce_scatter_quantizes_only_across() -> None:
    nodes = ["a", "b", "a", "b"]  # Ray interleaved them: positions are 0, 2, 1, 3
    xs = inputs(4, 4096)
    total = sum(xs)
    mesh = plan_mesh(Topology(grad_comm="int8"), nodes)
    q = BlockQuant(8, 256)

    def run(g: ThreadGroup) -> tuple[int, torch.Tensor, dict[int, int]]:
        m = MeshGroup(g, mesh, grad_codec=q)
        assert m.hierarchical
        part = m.reduce_scatter_(xs[g.rank].clone()).clone()
        return m.rank, part, g.counters.by_peer()

    for r, (position, part, peers) in enumerate(on_threads(4, run)):
        assert position == mesh.position(r)
        want = total.view(4, -1)[position]
        assert float((part - want).norm() / want.norm()) < 0.02
        across = sum(b for p, b in peers.items() if nodes[p] != nodes[r])
        assert across == q.nbytes(1024)  # one encoded chunk to the other node; fp32 inside


def test_coded_all_gather_identical_everywhere() -> None:
    xs = inputs(4, 2048)
    mesh = plan_mesh(Topology(shard_group_size=4), ["n"] * 4)
    q = BlockQuant(8, 128)

    def run(g: ThreadGroup) -> torch.Tensor:
        m = MeshGroup(g, mesh)
        buf = torch.zeros(2048)
        buf.view(4, -1)[m.rank].copy_(xs[g.rank].view(4, -1)[m.rank])
        m.all_gather_coded_(buf, q, op="all_gather_forward")
        return buf

    got = on_threads(4, run)
    want = torch.cat([xs[r].view(4, -1)[r] for r in range(4)])
    assert all(torch.equal(got[0], b) for b in got[1:])
    assert bool(((got[0] - want).abs() <= q.bound(want) * (1 + 1e-6)).all())


def test_subgroup_scalars_and_send_recv_map_to_world_ranks() -> None:
    from zero_ray.collective.subgroup import SubGroup

    def run(g: ThreadGroup) -> tuple[list[float], float]:
        sub = SubGroup(g, [1, 3] if g.rank % 2 else [0, 2], me=g.rank)
        summed = sub.all_reduce_values([float(g.rank), 1.0, 0.5])
        got = torch.zeros(1)
        sub.send_recv([(torch.tensor([float(g.rank)]), 1 - sub.rank)], [(got, 1 - sub.rank)], op="p2p")
        return summed, float(got)

    out = on_threads(4, run)
    assert out[0][0] == [2.0, 2.0, 1.0] and out[1][0] == [4.0, 2.0, 1.0]
    assert [v for _, v in out] == [2.0, 3.0, 0.0, 1.0]
