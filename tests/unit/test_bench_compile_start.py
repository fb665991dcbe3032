"""benchmarks.compile_start's pure parts: the table and the argument check (the trials
themselves run compiled owners in fresh processes: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from benchmarks.compile_start import StartRow, main, render


def test_the_table_has_one_row_per_trial_in_order() -> None:
    rows = [StartRow(trial=t, construct_s=1.0, first_step_s=f, second_step_s=0.16, steady_step_s=0.15)
            for t, f in (("eager", 0.19), ("cold", 19.27), ("warm", 3.68))]
    table = render(rows, stage=3, model="gpt", machine="here")
    body = [line for line in table.splitlines() if line.startswith("| ") and "trial" not in line]
    assert [line.split("|")[1].strip() for line in body] == ["eager", "cold", "warm"]
    assert "| cold | 1.00 | 19.27 | 0.160 | 0.150 |" in table and "--stage 3 --model gpt" in table


def test_too_few_steps_are_refused_by_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--steps", "2"])
    assert "--steps=2: at least 3" in capsys.readouterr().err
