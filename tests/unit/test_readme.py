"""The README's two commands are the ones the project runs."""

from __future__ import annotations

import os
import re

from tests_paths import REPO_ROOT


def _commands() -> list[str]:
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    main_job, tests = commands
    assert main_job.endswith("python examples/train_gpt.py")
    assert tests.endswith("python -m pytest -q")
    with open(os.path.join(REPO_ROOT, ".ci", "run"), encoding="utf-8") as fh:
        ci_lines = [line for line in fh.read().splitlines() if line and not line.startswith("#")]
    assert tests in ci_lines
    assert os.path.exists(os.path.join(REPO_ROOT, "examples", "train_gpt.py"))
