"""``benchmarks.offload_capacity``'s arithmetic and table: the parameter count is GPT-2's own
(built on the meta device), and a row says where the state lived and why a run did not train."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from benchmarks.offload_capacity import CapacityRow, gpt2, param_count, table


@pytest.mark.parametrize(("layers", "width"), [(2, 128), (3, 256)])
def test_the_parameter_count_is_gpt2s(layers: int, width: int) -> None:
    with torch.device("meta"):
        model = gpt2(layers, width)
    assert param_count(layers, width) == sum(p.numel() for p in model.parameters())


def test_a_row_says_where_the_state_lived_and_what_stopped_a_run() -> None:
    trained = CapacityRow(layers=46, width=2048, params=2_419_476_480, state_bytes=16 * 2_419_476_480,
                          machine_bytes=24 * 2**30, offload=True, capped=False, trained=True, build_s=100.0,
                          losses=[11.0, 9.5, 8.25], step_s=[120.0, 100.0, 90.0], peak_rss=[2**31, 3 * 2**30],
                          nvme=[9 * 2**30], resident=[2**30], read_bytes=30 * 2**30, written_bytes=40 * 2**30,
                          lowest_available=4 * 2**30)
    failed = CapacityRow(layers=24, width=2048, params=10**9, state_bytes=16 * 10**9, machine_bytes=24 * 2**30,
                         offload=False, capped=True, error="MemoryError while building")
    text = table([asdict(trained), asdict(failed)])
    assert ("| 46 x 2048 | 2.42B | 1.50x | optimizer + params on NVMe | yes | 11.000 → 9.500 → 8.250 | 100 "
            "| 120 / 100 / 90 | 3.00 | 9.00 | 30.0 / 40.0 | 4.0 |") in text
    assert "| 24 x 2048 | 1.00B | 0.62x | in memory, capped | no: MemoryError while building |" in text
