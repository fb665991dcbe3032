"""full_state_dict under tensor parallelism (driver/tp_consolidation.py): every owner's master
fragments joined into whole parameters by the plan. Pure: a module's whole tensors cut as the
owners hold them (TP shards by the plan, each partitioned over D data-parallel ranks), joined
back exactly."""

from __future__ import annotations

import torch
from torch import nn

from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.driver.tp_consolidation import join_fragments, split_dims

T, D = 2, 2
PLAN = {"up": "colwise", "down": "rowwise"}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def test_the_owners_fragments_join_into_the_whole_parameters() -> None:
    torch.manual_seed(0)
    whole = {n: p.detach().clone() for n, p in Mlp().named_parameters()}
    dims = split_dims(Mlp, TensorParallel(size=T, plan=PLAN))
    assert dims == {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # a rowwise bias stays whole
    local = [{n: (v.chunk(T, dim=dims[n])[t] if n in dims else v) for n, v in whole.items()} for t in range(T)]
    gathered = []
    for r in range(T * D):  # owner r: data-parallel rank r // T's range of TP rank r % T's shard
        d, t = divmod(r, T)
        frags = {}
        for name, value in local[t].items():
            flat = value.reshape(-1)
            lo, hi = d * flat.numel() // D, (d + 1) * flat.numel() // D
            frags[name] = (lo, hi, flat[lo:hi].clone())
        gathered.append(frags)
    shapes = {n: tuple(v.shape) for n, v in local[0].items()}
    got = join_fragments(gathered, local_shapes=shapes, size=T, dims=dims)
    assert got.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(got[name], value), name


def test_without_tensor_parallelism_it_is_the_plain_consolidation() -> None:
    values = torch.arange(6.0)
    got = join_fragments([{"w": (0, 4, values[:4])}, {"w": (4, 6, values[4:])}], local_shapes={"w": (2, 3)},
                         size=1, dims={})
    assert torch.equal(got["w"], values.view(2, 3))
