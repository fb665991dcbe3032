"""The package's import graph, read from the sources: no cycles, and dependencies pointing one
way (driver -> owner -> collective -> core; control/, checkpoint/ and data/ know neither driver
nor owner; the pure planning modules import neither ray, grpc nor torch; the library imports no
test or benchmark code)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

from tests_paths import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "zero_ray")
PURE = ("core.flat_layout", "core.reshard_plan", "core.memory_formulas", "core.elastic_policy", "core.stage3_units", "core.stages", "core.group_policy",
        "core.updated_params", "core.whole_tensor_assignees", "core.optim_state", "checkpoint.format", "core.topology", "core.restore_plan",
        "core.stall_diagnosis", "core.run_position", "core.relay_tree", "core.reply_combine", "core.tensor_parallel_plan",
        "core.ray_names")
# package -> packages it must never import (directly or lazily)
FORBIDDEN = {
    "core": ("driver", "owner", "collective", "control", "checkpoint", "testing", "cli", "config", "compat"),
    "collective": ("driver", "owner", "control", "checkpoint", "testing", "cli"),
    "owner": ("driver", "testing", "cli"),
    "control": ("driver", "owner", "testing", "cli"),
    "checkpoint": ("driver", "owner", "testing", "cli"),
    "data": ("driver", "owner", "collective", "control", "testing", "cli"),
}
# owner/'s rooms, highest first: a room imports only the rooms after it (construction and
# tensors, the two lowest, know nothing of each other).
OWNER_ROOMS = ("service", "resilience", "step", "construction", "tensors")
FORBIDDEN.update({f"owner.{room}": tuple(f"owner.{r}" for r in OWNER_ROOMS[:i + 1] if r != room)
                  for i, room in enumerate(OWNER_ROOMS)})
FORBIDDEN["owner.construction"] += ("owner.tensors",)
# Compute never speaks the wire: only the service room converts records to control messages.
for _room in OWNER_ROOMS[1:]:
    FORBIDDEN[f"owner.{_room}"] += ("control",)
# Code for tests and benchmarks inside the package (the reference runs): it may
# import the library, the library never imports it.
SUPPORT = ("testing",)


def _modules() -> Iterator[tuple[str, str]]:
    for root, _, files in os.walk(PACKAGE):
        if "_generated" in root:
            continue  # generated gRPC code is never edited
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__").removesuffix("__init__"), path


MODULES = {"zero_ray." + name if name else "zero_ray" for name, _ in _modules()}
# compat/ (the adapters over ray's and torch's private APIs) is a leaf: it imports ray, torch
# and zero_ray.errors, nothing else of the package.
FORBIDDEN["compat"] = tuple(sorted({m.split(".")[1] for m in MODULES if m.count(".")} - {"compat", "errors"}))


def _imports(path: str) -> set[str]:
    """Every module this file imports anywhere (module level, functions, TYPE_CHECKING):
    ``from package import submodule`` counts as the submodule, not the package's __init__."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES
            out.update(subs or {node.module})
    return out


GRAPH = {}
for _name, _path in _modules():
    GRAPH[_name] = {i.removeprefix("zero_ray").removeprefix(".") for i in _imports(_path) if i in MODULES}


def test_the_import_graph_has_no_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    # the package's __init__ re-exports the public API: it may import anything, nothing imports it
    assert [c for c in cycles if "" not in c] == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package: str) -> None:
    bad = sorted((m, i) for m, deps in GRAPH.items() if m.startswith(package + ".") for i in deps
                 if any(i == f or i.startswith(f + ".") for f in FORBIDDEN[package]))
    assert bad == []


def test_every_owner_module_is_in_a_room() -> None:
    rooms = {f"owner.{room}" for room in OWNER_ROOMS}
    loose = sorted(m for m in GRAPH if m.startswith("owner.") and ".".join(m.split(".")[:2]) not in rooms)
    assert loose == []


@pytest.mark.parametrize("module", PURE)
def test_planning_code_imports_neither_ray_grpc_nor_torch(module: str) -> None:
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    heavy = {i.split(".")[0] for i in _imports(path)} & {"ray", "grpc", "torch"}
    assert heavy == set()


def test_the_library_imports_no_test_support() -> None:
    bad = sorted((m, i) for m, deps in GRAPH.items() if m.split(".")[0] not in SUPPORT for i in deps
                 if i.split(".")[0] in SUPPORT)
    assert bad == []


def test_nothing_in_the_package_imports_the_benchmarks() -> None:
    # benchmarks/ is in a source checkout only: an installed zero_ray could not import it.
    bad = sorted((name, i) for name, path in _modules() for i in _imports(path) if i.split(".")[0] == "benchmarks")
    assert bad == []
