"""Files in the package stay under 600 lines, each with one job (generated gRPC code aside)."""

from __future__ import annotations

import os

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
