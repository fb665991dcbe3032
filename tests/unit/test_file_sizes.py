"""Files in the package stay under 600 lines, each with one job, and no file name appears twice
(generated gRPC code aside)."""

from __future__ import annotations

import os
from collections import defaultdict

from tests_paths import REPO_ROOT

LIMIT = 600


def test_no_file_in_the_package_is_over_600_lines() -> None:
    package = os.path.join(REPO_ROOT, "zero_ray")
    long = []
    for root, _, files in os.walk(package):
        if "_generated" in root:
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as fh:
                    lines = sum(1 for _ in fh)
                if lines > LIMIT:
                    long.append(f"{os.path.relpath(path, REPO_ROOT)}: {lines} lines")
    assert long == [], f"split these by job: {long}"


def test_no_file_name_appears_twice_in_the_package() -> None:
    """A name says what its file holds, so one name is one thing: ``schedule.py`` was both an LR
    schedule and stage-3 gathering. Packages' ``__init__.py`` and ``__main__.py`` aside."""
    package = os.path.join(REPO_ROOT, "zero_ray")
    where: dict[str, list[str]] = defaultdict(list)
    for root, _, files in os.walk(package):
        if "_generated" in root:
            continue
        for name in files:
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                where[name].append(os.path.relpath(os.path.join(root, name), REPO_ROOT))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert twice == {}, f"rename one of each so the name says what it holds: {twice}"
