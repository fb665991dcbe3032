"""The committed stubs are exactly what codegen produces, and the control layer keeps
to its dependency rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zero_ray.control import codegen, record_gen

pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs")

CONTROL = Path(codegen.__file__).resolve().parent
COMMITTED = CONTROL / "_generated"
ROOT = CONTROL.parents[1]


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = {path.name: path for path in codegen.generate(tmp_path)}
    committed = {path.name: path for path in COMMITTED.iterdir() if codegen.is_generated(path)}
    for module, _ in record_gen.MODULES:  # the plain records live in core/
        committed[Path(module).name] = ROOT / module
    assert sorted(fresh) == sorted(committed), "generated file set differs; run python -m zero_ray.control.codegen"
    stale = [name for name in sorted(fresh) if fresh[name].read_bytes() != committed[name].read_bytes()]
    assert not stale, f"stale stubs {stale}: run python -m zero_ray.control.codegen and commit the result"
    # The stubs import each other inside the package, which is the point of the -I mapping.
    assert "from zero_ray.control._generated import common_pb2" in fresh["owner_pb2.py"].read_text()


def test_generation_removes_stale_stubs(tmp_path: Path) -> None:
    target = tmp_path / codegen.GENERATED_PACKAGE
    target.mkdir(parents=True)
    (target / "removed_pb2.py").write_text("# from a proto that no longer exists\n")
    (target / "__init__.py").write_text("")
    names = {path.name for path in codegen.generate(tmp_path)}
    assert all((tmp_path / module).is_file() for module, _ in record_gen.MODULES)
    assert "removed_pb2.py" not in names and not (target / "removed_pb2.py").exists()
    assert (target / "__init__.py").exists()  # hand-written files stay


def test_control_imports_only_errors_and_core() -> None:
    allowed = ("zero_ray.errors", "zero_ray.core", "zero_ray.control")
    offenders = []
    for path in CONTROL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.name}: {name}" for name in names
                          if name.split(".")[0] == "zero_ray" and not name.startswith(allowed)]
    assert not offenders, f"zero_ray.control may import zero_ray.errors and zero_ray.core only: {offenders}"
