"""`zero-ray status` (polled by operators and tests/integration/test_driver_loss.py) and every
`--help` run without importing torch (about a second per call); `zero-ray train` still gets the
main job's arguments, added when it is the command parsed (zero_ray/cli/command_parser.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests_paths import REPO_ROOT

_PROBE = """
import sys
from zero_ray.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("TORCH", "torch" in sys.modules, "ray" in sys.modules)
"""


def _probe(*argv: str) -> tuple[str, bool]:
    """(what the command printed, whether torch was imported by then)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    text, _, flags = out.rpartition("TORCH ")
    return text, flags.split()[0] == "True"


@pytest.mark.parametrize("argv", [("--help",), ("status", "--help"), ("checkpoint", "--help"),
                                  ("checkpoint", "inspect", "--help"), ("estimate", "--help")])
def test_help_does_not_import_torch(argv: tuple[str, ...]) -> None:
    text, torch_loaded = _probe(*argv)
    assert "usage: zero-ray" in text
    assert not torch_loaded, f"zero-ray {' '.join(argv)} imported torch"


def test_train_help_still_lists_the_main_jobs_arguments() -> None:
    text, torch_loaded = _probe("train", "--help")
    assert "usage: zero-ray train" in text and "--world-size" in text and "--stage" in text
    assert "standard library" in text  # zero_ray.demo's docstring is the description
    assert torch_loaded


def test_the_status_path_imports_no_torch_before_a_run_answers() -> None:
    code = ("import sys, ray, zero_ray.cli.operator_commands, zero_ray.driver.attach; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.split() == ["False"]
