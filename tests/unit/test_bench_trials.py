"""benchmarks.harness.trials: a trial's failure names it, and the results land as JSON and a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness.trials import run_child, write_results


def test_a_failed_trial_is_named_with_its_exit_status_and_error() -> None:
    with pytest.raises(RuntimeError, match=r"the cold trial failed \(exit 1\): .*No module named "
                                           r"benchmarks\.harness\.no_such_benchmark"):
        run_child("benchmarks.harness.no_such_benchmark", [], name="cold", timeout_s=60)


def test_results_are_written_as_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_results(str(tmp_path / "out"), "bench", {"rows": [{"trial": "a", "s": 1.5}]}, "| a | 1.5 |")
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == {"rows": [{"trial": "a", "s": 1.5}]}
    assert (tmp_path / "out" / "bench.md").read_text() == "| a | 1.5 |\n"
    assert "| a | 1.5 |" in capsys.readouterr().out
