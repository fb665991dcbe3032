"""Collaborators are passed in, never the creator: read from the sources, as test_layering reads
the imports.

Three shapes of the same loop, each a finding of the issue-43 review:

- an object hands ``self`` to a class or function of another module (``OwnerControl(self)``,
  ``Coordinator(self)``, ``fit(self, ...)``), which then calls back into it;
- a Protocol whose one implementer is in a module of the same package that imports the
  Protocol's module (the ``GroupListener`` the reducer implemented for the groups it reduces);
- a base class from another module that uses attributes it does not declare (the ``ResumeAPI``
  mixin reaching into the trainer's fields).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tests_paths import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "zero_ray")


@dataclass(frozen=True)
class Module:
    name: str
    tree: ast.Module

    def imported(self) -> dict[str, str]:
        """Local name -> the zero_ray module it comes from (``from zero_ray.x import y``)."""
        out: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zero_ray"):
                for alias in node.names:
                    out[alias.asname or alias.name] = node.module
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("zero_ray"):
                        out[alias.asname or alias.name] = alias.name
        return out

    def classes(self) -> Iterator[ast.ClassDef]:
        return (node for node in ast.walk(self.tree) if isinstance(node, ast.ClassDef))


def _modules() -> list[Module]:
    out = []
    for root, _, files in os.walk(PACKAGE):
        if "_generated" in root:
            continue
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = "zero_ray." + os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                out.append(Module(name.removesuffix(".__init__"), ast.parse(open(path, encoding="utf-8").read())))
    return out


MODULES = _modules()
BY_NAME = {m.name: m for m in MODULES}


def _callee_root(func: ast.expr) -> str | None:
    while isinstance(func, ast.Attribute):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None


def _calls_outside_validation(tree: ast.AST) -> Iterator[ast.Call]:
    # A record that hands itself to a check in __post_init__ is a value being validated, not a
    # creator waiting for a call back.
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            continue
        if isinstance(node, ast.Call):
            yield node
        yield from _calls_outside_validation(node)


def test_no_object_hands_itself_to_another_modules_code() -> None:
    found = []
    for m in MODULES:
        imported = m.imported()
        for node in _calls_outside_validation(m.tree):
            if not isinstance(node, ast.Call):
                continue
            args = [*node.args, *(k.value for k in node.keywords)]
            if not any(isinstance(a, ast.Name) and a.id == "self" for a in args):
                continue
            root = _callee_root(node.func)
            if root in imported:  # a class or function of another zero_ray module
                found.append(f"{m.name}:{node.lineno}: {ast.unparse(node.func)}(self)")
    assert found == []


def _protocols() -> Iterator[tuple[Module, ast.ClassDef, set[str]]]:
    for m in MODULES:
        for cls in m.classes():
            if any(ast.unparse(b) in ("Protocol", "typing.Protocol") for b in cls.bases):
                names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                yield m, cls, names


def _members(cls: ast.ClassDef) -> set[str]:
    out = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    out.add(target.attr)
    return out


def test_no_protocol_is_implemented_only_by_its_creator() -> None:
    found = []
    for pm, protocol, names in _protocols():
        if not names:
            continue
        implementers = [(m, cls) for m in MODULES for cls in m.classes()
                        if cls is not protocol and names <= _members(cls)]
        if len(implementers) == 1:
            m, cls = implementers[0]
            # Within one package that is a loop; a lower package's Protocol that a higher one
            # implements (core.stall_diagnosis's event, met by collective's) is dependency inversion.
            same_package = m.name.split(".")[1] == pm.name.split(".")[1]
            if m.name != pm.name and same_package and pm.name in set(m.imported().values()):
                found.append(f"{pm.name}.{protocol.name}: implemented only by {m.name}.{cls.name}, which imports it")
    assert found == []


def _self_reads(cls: ast.ClassDef) -> set[str]:
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Load)}


def _declared(cls: ast.ClassDef) -> set[str]:
    # Only the class's own top-level body and its own assignments: a TYPE_CHECKING block that
    # lists the host's attributes is the mixin's reach into its host, not a declaration.
    return _members(cls) | {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
                            if isinstance(t, ast.Name)}


def test_no_base_class_reaches_into_its_subclass() -> None:
    found = []
    for m in MODULES:
        imported = m.imported()
        for cls in m.classes():
            for base in cls.bases:
                name = ast.unparse(base)
                source = BY_NAME.get(imported.get(name, ""))
                if source is None:
                    continue
                base_cls = next((c for c in source.classes() if c.name == name), None)
                if base_cls is None or any(ast.unparse(b) in ("Protocol", "typing.Protocol") for b in base_cls.bases):
                    continue
                undeclared = sorted(a for a in _self_reads(base_cls) - _declared(base_cls) if not a.startswith("__"))
                if undeclared:
                    found.append(f"{m.name}.{cls.name}({name}): {name} uses {undeclared} of its host")
    assert found == []


def test_the_checks_see_the_shapes_they_forbid() -> None:
    # The rules above would pass vacuously on an empty package: confirm the scan finds
    # Protocols, cross-module bases and self-passing calls to judge.
    assert sum(1 for _ in _protocols()) >= 5
    assert any(isinstance(n, ast.Call) for m in MODULES for n in ast.walk(m.tree))
    sample = ast.parse("class A:\n    def f(self):\n        return self.x\n").body[0]
    assert isinstance(sample, ast.ClassDef) and _self_reads(sample) - _declared(sample) == {"x"}
