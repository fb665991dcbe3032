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


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    return project["dependencies"], project["optional-dependencies"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9_.-]+)", requirement).group(1)).lower()  # type: ignore[union-attr]


def _provided(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: each one, and what it requires unconditionally
    or through the extras asked for (one level: enough for moto's boto3)."""
    from importlib import metadata

    names = set()
    for requirement in requirements:
        name = _name(requirement)
        names.add(name)
        asked = set(re.findall(r"\[([^\]]*)\]", requirement)[0].split(",")) if "[" in requirement else set()
        try:
            below = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for sub in below:
            marker = sub.split(";", 1)[1] if ";" in sub else ""
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", marker)
            if extra is None or extra.group(1) in asked:
                names.add(_name(sub))
    return names


def _benchmark_imports() -> dict[str, str]:
    """Every third-party top-level module benchmarks/ imports, with a file that imports it."""
    import ast
    import sys

    found: dict[str, str] = {}
    root = os.path.join(REPO_ROOT, "benchmarks")
    for folder, _, files in os.walk(root):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    ours = top in ("zero_ray", "benchmarks") or os.path.exists(os.path.join(REPO_ROOT, "tests", f"{top}.py"))
                    if not ours and top not in sys.stdlib_module_names:
                        found.setdefault(top, os.path.relpath(path, REPO_ROOT))
    return found


def test_the_bench_extra_the_readme_names_installs_what_the_benchmarks_import() -> None:
    from importlib import metadata

    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert "pip install -e '.[bench]'" in readme and "pip install -e '.[hf]'" in readme
    core, extras = _extras()
    assert {"transformers", "peft"} <= {_name(r) for r in extras["hf"]}
    installed = _provided(core + extras["bench"])
    optional = {_name(r) for r in extras["bench-deepspeed"]}  # DeepSpeed's rows say "unavailable" without it
    by_module = metadata.packages_distributions()
    imports = _benchmark_imports()
    assert {"torch", "ray", "transformers", "moto", "matplotlib"} <= set(imports)  # the scan sees them
    missing = {}
    for module, where in imports.items():
        dists = {_name(d) for d in by_module.get(module, [module])}
        if not dists & (installed | optional):
            missing[module] = where
    assert not missing, f"benchmarks import modules no core dependency or the bench extra installs: {missing}"
