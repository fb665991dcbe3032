"""benchmarks.tensor_parallel's pure parts: the longest length solved from two measured steps, and
the per-thread byte count its budget is enforced by."""

from __future__ import annotations

import torch

from benchmarks.tensor_parallel import KindBytes, RankBytes, Step, _ModuleStack, solve


def step(seq: int, peak: int) -> Step:
    return Step(seq=seq, step_s=0.0, peak_bytes=peak, held_bytes=0, tp_bytes=0, tp_activation_bytes=0, dp_bytes=0,
                activation_bytes=0, loss=0.0)


def test_solve_takes_the_longest_granule_multiple_under_the_budget() -> None:
    a, b = step(100, 1_000 + 100 * 10), step(200, 1_000 + 200 * 10)  # 10 bytes a token over 1,000
    assert solve(a, b, budget=1_000 + 1_000 * 10, granule=1) == 1_000
    assert solve(a, b, budget=1_000 + 1_000 * 10 - 1, granule=64) == 960
    assert solve(a, b, budget=500, granule=64) == 0


def test_rank_bytes_counts_live_storages_and_their_peak() -> None:
    mode = RankBytes()
    with mode:
        x = torch.ones(1024)  # 4 KiB
        y = x * 2  # 4 KiB more
        del x, y
        z = torch.zeros(256)  # 1 KiB
    assert mode.peak == 8192
    assert mode.live == 1024
    del z


def test_kind_bytes_names_what_made_each_storage_and_keeps_the_kinds_at_the_peak() -> None:
    stack = _ModuleStack()
    mode = KindBytes(stack, hidden=8, vocab=16, intermediate=12, size=1, seq=4)
    with mode:
        stack.modules.append(torch.nn.LayerNorm(8))
        a = torch.empty(1, 4, 8)  # 128 bytes in a norm's forward
        stack.modules.pop()
        b = torch.empty(1, 4, 16)  # 256 bytes over the vocabulary, outside any module
        del b
        c = torch.empty(4)  # 16 bytes: below the peak
    assert mode.peak == 384
    assert {k: n for k, n in mode.at_peak.items() if n} == {"forward: LayerNorm": 128,
                                                            "outside modules: vocabulary": 256}
    del a, c


def test_rank_bytes_counts_no_storage_that_existed_before_the_op() -> None:
    # a parameter first seen through a view (F.linear's weight.t()) is held state, not a step's
    # allocation: counted, it was labelled "forward: LlamaAttention's linear outputs"
    weight, x = torch.ones(32, 16), torch.ones(4, 16)
    mode = RankBytes()
    with mode:
        view = weight.t()
        weight.mul_(2)
        y = torch.nn.functional.linear(x, weight)  # 4 x 32 x 4 bytes: new
    assert mode.peak == mode.live == 512
    del view, y


def test_kind_bytes_names_p_a_only_where_it_is_on_and_counts_inside_the_tp_collectives() -> None:
    from zero_ray.collective.collective_api import SoloGroup
    from zero_ray.owner.construction.group_ops import register_group, tp_all_reduce

    stack, kept = _ModuleStack(), {}
    group = SoloGroup()
    handle = register_group(group)
    for partition in (True, False):
        mode = KindBytes(stack, hidden=8, vocab=16, intermediate=12, size=2, seq=4, partition=partition)
        with mode:
            a = torch.zeros(16)  # a 1-D slice of a block's input: seq x hidden / T elements
            b = tp_all_reduce(torch.ones(3, 8), handle)  # its body's padded flat buffer, seen by the mode
        kept[partition] = {k: n for k, n in mode.at_peak.items() if n}
        del a, b
    assert kept[True]["P_a: kept slices of the blocks' inputs"] == 64
    assert "P_a: kept slices of the blocks' inputs" not in kept[False]
    assert kept[False]["flat buffers (gradients, staging) and scalars: fixed"] == 64
    assert kept[True]["forward: tp_all_reduce's flat buffers"] == 3 * 8 * 4
