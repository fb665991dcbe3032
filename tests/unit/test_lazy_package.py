"""zero_ray/__init__ loads its public names on first use: every owner actor imports the package on
its way to zero_ray.owner, so an eager import of the driver there costs each owner start the
driver's modules (~0.1 s with torch and Ray loaded). Read from the source, and each public name
resolved to the object its module defines."""

from __future__ import annotations

import ast
import importlib
import os

import zero_ray as zr
from tests_paths import REPO_ROOT

INIT = os.path.join(REPO_ROOT, "zero_ray", "__init__.py")
EAGER = {"__future__", "importlib", "typing", "zero_ray.errors", "zero_ray.submit"}  # none imports the driver


def _module_level_imports() -> tuple[set[str], set[str]]:
    """(modules imported at run time, modules imported under ``if TYPE_CHECKING``) by the package."""
    tree = ast.parse(open(INIT, encoding="utf-8").read())
    run_time: set[str] = set()
    checking: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                assert isinstance(sub, ast.ImportFrom) and sub.module
                checking.update(f"{sub.module}.{a.name}" if sub.module == "zero_ray" else sub.module for a in sub.names)
        elif isinstance(node, ast.Import):
            run_time.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            run_time.add(node.module)
    return run_time, checking


def test_the_package_imports_only_cheap_modules_at_run_time() -> None:
    run_time, _ = _module_level_imports()
    assert run_time <= EAGER, f"zero_ray/__init__ imports {sorted(run_time - EAGER)} eagerly: add it to _LAZY"


def test_every_public_name_resolves_to_its_modules_object() -> None:
    lazy = zr._LAZY
    assert set(lazy) <= set(zr.__all__) and set(lazy) <= set(dir(zr))
    _, checking = _module_level_imports()
    assert set(lazy.values()) <= checking | {f"zero_ray.{n}" for n in lazy}  # type checkers see each one
    for name in zr.__all__:
        value = getattr(zr, name)
        if name in lazy:
            module = importlib.import_module(lazy[name])
            assert value is (module if lazy[name] == f"zero_ray.{name}" else getattr(module, name)), name
    assert callable(zr.submit) and zr.ZeroTrainer.__name__ == "ZeroTrainer"
