"""Ring collectives on real Ray actors over gloo: results, bytes sent, timeouts."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import ray
import torch

from zero_ray.collective.ray_group import destroy_group, form_group
from zero_ray.errors import CollectiveTimeout

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=1)
class Rank:
    def __init__(self, rank: int, world_size: int, name: str, timeout_s: float) -> None:
        self.rank, self.world_size, self.name, self.timeout_s = rank, world_size, name, timeout_s

    def ready(self) -> None:
        """Answers once the actor's process is up."""

    def join(self) -> None:
        self.group = form_group(backend="gloo", group_name=self.name, rank=self.rank,
                                world_size=self.world_size, timeout_s=self.timeout_s)

    def run(self, op: str, numel: int, dtype: str) -> tuple[torch.Tensor, dict[str, int]]:
        torch.manual_seed(self.rank)
        buf = torch.randn(numel).to(getattr(torch, dtype))
        self.group.counters.reset()
        if op == "reduce_scatter":
            out = self.group.reduce_scatter_(buf).clone()
        elif op == "all_gather":
            out = buf.clone()
            out.chunk(self.world_size)[self.rank].fill_(float(self.rank + 1))
            self.group.all_gather_(out)
        else:
            out = buf.clone()
            self.group.all_reduce_(out)
        return out, self.group.counters.snapshot()

    def ring_and_direct(self, numel: int) -> list[bool]:
        """Whether the direct path (small buffers) gives the ring's bits, per collective."""
        import zero_ray.collective.ray_group as ray_group

        torch.manual_seed(100 + self.rank)
        source = torch.randn(numel)
        out = {}
        for path, limit in (("direct", ray_group.DIRECT_MAX_BYTES), ("ring", 0)):
            ray_group.DIRECT_MAX_BYTES, saved = limit, ray_group.DIRECT_MAX_BYTES
            try:
                rs = self.group.reduce_scatter_(source.clone()).clone()
                ar = source.clone()
                self.group.all_reduce_(ar)
                ag = source.clone()
                self.group.all_gather_(ag)
            finally:
                ray_group.DIRECT_MAX_BYTES = saved
            out[path] = (rs, ar, ag)
        return [torch.equal(a, b) for a, b in zip(out["direct"], out["ring"])]

    def values(self, values: list[float]) -> list[float]:
        return self.group.all_reduce_values(values)

    def lonely_reduce_scatter(self) -> str:
        try:
            self.group.reduce_scatter_(torch.zeros(8))
        except CollectiveTimeout as err:
            return str(err)
        return "completed"

    def leave(self) -> None:
        destroy_group(self.name)


def _group(n: int, timeout_s: float = 30.0) -> list:
    name = f"test-{uuid.uuid4().hex[:8]}"
    ranks = [Rank.remote(r, n, name, timeout_s) for r in range(n)]
    # Every process up first: the formation's timeout_s then bounds the rendezvous, not the skew
    # between two actors' starts (seconds on a loaded machine, past a short timeout_s).
    ray.get([a.ready.remote() for a in ranks], timeout=120)
    ray.get([a.join.remote() for a in ranks], timeout=120)
    return ranks


def _stop(ranks: list) -> None:
    for a in ranks:
        ray.kill(a)


@pytest.fixture(scope="module")
def group(request: pytest.FixtureRequest) -> Iterator[list]:
    """A formed group of ``request.param`` ranks, shared by the tests of that size (pytest runs
    them one after the other and stops the group before forming the next): starting the
    actors (each imports torch) is most of a test's time, and their collectives leave it usable."""
    ranks = _group(request.param)
    yield ranks
    _stop(ranks)


@pytest.mark.parametrize("group", [2, 3, 4], indirect=True)
def test_reduce_scatter_all_gather_all_reduce_are_exact_and_send_n_minus_1_over_n(group: list) -> None:
    ranks, n = group, len(group)
    numel = 12 * 1024
    inputs = []
    for r in range(n):
        torch.manual_seed(r)
        inputs.append(torch.randn(numel))
    total = torch.stack(inputs).sum(0)
    chunk = numel // n
    for r, (out, sent) in enumerate(ray.get([a.run.remote("reduce_scatter", numel, "float32") for a in ranks])):
        torch.testing.assert_close(out, total.chunk(n)[r], rtol=1e-6, atol=1e-6)
        assert sent == {"reduce_scatter": (n - 1) * chunk * 4}
    for out, sent in ray.get([a.run.remote("all_gather", numel, "float32") for a in ranks]):
        assert [float(c[0]) for c in out.chunk(n)] == [float(r + 1) for r in range(n)]
        assert sent == {"all_gather": (n - 1) * chunk * 4}
    results = ray.get([a.run.remote("all_reduce", numel, "float32") for a in ranks])
    for out, sent in results:
        assert torch.equal(out, results[0][0])  # identical bits on every rank
        torch.testing.assert_close(out, total, rtol=1e-5, atol=1e-5)
        assert sent == {"all_reduce": 2 * (n - 1) * chunk * 4}
    # bf16 moves half the bytes
    for _, sent in ray.get([a.run.remote("reduce_scatter", numel, "bfloat16") for a in ranks]):
        assert sent == {"reduce_scatter": (n - 1) * chunk * 2}
    assert ray.get([a.values.remote([1.0, float(i)]) for i, a in enumerate(ranks)])[0] == [n, sum(range(n))]


@pytest.mark.parametrize("group", [3, 4], indirect=True)
def test_small_buffers_sent_to_every_peer_at_once_give_the_rings_bits(group: list) -> None:
    for equal in ray.get([a.ring_and_direct.remote(12 * 1024) for a in group], timeout=120):
        assert equal == [True, True, True]  # reduce-scatter, all-reduce, all-gather


def test_a_collective_whose_peer_never_comes_times_out_with_a_domain_error() -> None:
    # 5 s: the formation's rendezvous is bounded by the same timeout, and on a loaded machine
    # (load 25-35 on 2 cores) it took longer than 1.5 s.
    ranks = _group(2, timeout_s=5.0)
    try:
        message = ray.get(ranks[0].lonely_reduce_scatter.remote(), timeout=60)
        assert "timed out after 5s" in message and "rank 0 of 2" in message
    finally:
        _stop(ranks)
