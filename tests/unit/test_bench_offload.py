"""benchmarks.offload: both trials at a tiny size in this process (the same bits, the state on
disk in one), the table, and the argument check."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.offload import OffloadRow, _child, _trial, main, render


def _args(path: Path) -> argparse.Namespace:
    return argparse.Namespace(layers=1, width=32, vocab=64, seq=8, batch=2, steps=2, bucket_mib=1, path=str(path),
                              timeout=300.0)


def test_both_trials_train_the_same_bits_and_only_one_uses_the_disk(tmp_path: Path) -> None:
    memory, nvme = _child(_args(tmp_path), False), _child(_args(tmp_path), True)
    assert memory.params_sha256 == nvme.params_sha256
    assert memory.nvme_bytes == 0 < nvme.nvme_bytes <= nvme.optimizer_bytes == memory.optimizer_bytes
    assert 0 < nvme.window_bytes <= nvme.nvme_bytes
    # the breakdown: a streamed update has its parts (checksums both ways), one in memory has none
    assert memory.verify_s == memory.optimizer_s == memory.seal_s == memory.read_s == 0.0
    assert nvme.verify_s > 0 and nvme.optimizer_s > 0 and nvme.seal_s > 0 and nvme.read_s > 0
    for row in (memory, nvme):
        assert 0 < row.compute_s < row.steady_step_s and row.update_s > 0


def test_a_trial_runs_in_a_process_of_its_own(tmp_path: Path) -> None:
    row = _trial("nvme", _args(tmp_path))
    assert row.trial == "nvme" and row.nvme_bytes > 0 and row.params_sha256 == _child(_args(tmp_path), True).params_sha256


def test_the_table_compares_each_trial_with_memory() -> None:
    memory = OffloadRow(trial="memory", params=124_000_000, optimizer_bytes=2**30, nvme_bytes=0,
                        window_bytes=50 * 2**20, peak_rss_bytes=3 * 2**30, steady_peak_rss_bytes=3 * 2**30,
                        first_step_s=4.0, steady_step_s=2.0, params_sha256="a", compute_s=1.5, update_s=0.5,
                        read_bytes=0, write_bytes=0)
    nvme = replace(memory, trial="nvme", nvme_bytes=2**30, steady_peak_rss_bytes=2 * 2**30, steady_step_s=2.5,
                   update_s=1.0, wait_s=0.0625, optimizer_s=0.5, drain_s=0.03125, read_s=0.375, verify_s=0.25,
                   seal_s=0.125, evict_s=0.01, write_bytes=512 * 2**20)
    table = render([memory, nvme], command="python -m benchmarks.offload", machine="here")
    assert "| nvme | 124.0M | 1024 MiB | 1024 MiB | 50 MiB | 3072 MiB | 2048 MiB | 1024 MiB | 4.00 | 2.50 | 1.25 | yes |" \
        in table
    assert ("| nvme | 2.50 | 1.50 | 1.00 | 0.062 | 0.500 | 0.031 | 0.375 | 0.250 | 0.125 | 0.010 | 0 MiB | 512 MiB |"
            in table)


def test_too_few_steps_are_refused_by_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--steps", "1"])
    assert "--steps=1: at least 2" in capsys.readouterr().err


def test_a_cold_trial_reads_every_steps_state_from_the_disk_and_trains_the_same_bits() -> None:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as disk:  # a disk, never a tmpfs
        args = replace_args(_args(Path(disk)), steps=3)
        cold, warm = _child(args, True, cold=True), _child(args, True)
    assert cold.params_sha256 == warm.params_sha256
    assert cold.read_bytes >= cold.nvme_bytes > 0 == warm.read_bytes  # all of it, each step


def replace_args(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})
