"""Private APIs of ray and torch are used only behind zero_ray/compat/ (one adapter per
dependency), and each adapter refuses, at import, a version it was not written for."""

from __future__ import annotations

import ast
import datetime
import os
import re

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from tests_paths import REPO_ROOT
from zero_ray.compat import ray_private, torch_private
from zero_ray.errors import UnsupportedVersionError

PACKAGE = os.path.join(REPO_ROOT, "zero_ray")
ROOTS = ("ray", "torch")
# Uses outside compat/ allowed for now (none: every private use goes through an adapter).
ELSEWHERE: dict[str, set[str]] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> set[str]:
    """Every private ray/torch API ``source`` reaches: an import of a private module or name,
    an attribute starting with ``_`` on anything reached from a name bound to ray or torch
    (through calls and subscripts: ``col.get_group_handle(n)._pg``), and an assignment to a
    module attribute of theirs (a process-wide patch such as ``c10d.default_pg_timeout = t``)."""
    tree = ast.parse(source)
    bound: set[str] = set()
    modules: set[str] = set()  # names bound to modules (an assignment to their attributes patches them)
    uses: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    name = a.asname or a.name.split(".")[0]
                    bound.add(name)
                    modules.add(name)
                    if any(_private(p) for p in a.name.split(".")):
                        uses.add(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ROOTS:
            if any(_private(p) for p in node.module.split(".")):
                uses.add(f"import {node.module}")
            for a in node.names:
                bound.add(a.asname or a.name)
                if _private(a.name):
                    uses.add(f"import {node.module}.{a.name}")

    def base(node: ast.expr) -> ast.expr:
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = base(node)
            if isinstance(root, ast.Name) and root.id in bound:
                uses.add(ast.unparse(node))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                chain = target
                while isinstance(chain, ast.Attribute):
                    chain = chain.value
                if isinstance(target, ast.Attribute) and isinstance(chain, ast.Name) and chain.id in modules:
                    uses.add(f"patch {ast.unparse(target)}")
    return uses


def _library_files() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        rel_root = os.path.relpath(root, PACKAGE)
        if "_generated" in rel_root or rel_root.split(os.sep)[0] == "compat":
            continue
        for f in files:
            if f.endswith(".py"):
                out[os.path.join(rel_root, f).removeprefix("./")] = os.path.join(root, f)
    return out


def test_no_private_ray_or_torch_api_outside_compat() -> None:
    found = {rel: uses for rel, path in sorted(_library_files().items())
             if (uses := private_uses(open(path, encoding="utf-8").read()))}
    assert found == ELSEWHERE


# -- private attributes of torch's objects (``module._parameters``, ``storage._cdata``) --------------
# The scan above follows names bound to the torch module; a torch object reached any other way
# (a function argument, a call's result) has no such name, so attributes are matched by name.
RECEIVERS_OF_OUR_OWN = ("self", "cls")  # zero_ray's own classes: their _names are their own
# Private names torch's objects have that a zero_ray class also defines as its own (the scan
# cannot tell whose object ``x._to`` is, so these are not flagged; a new one is a decision).
SHARED_WITH_TORCH = {"_to"}  # collective/collective_api.py's bytes-sent-per-peer counter


def torch_private_attributes() -> frozenset[str]:
    """The single-underscore attributes of torch's objects, read from the installed torch: the
    classes' own, and the instance attributes of a real module and optimizer (``_parameters``,
    ``_buffers``, ``_modules``, the hook dicts, ``_optimizer_step_code``...)."""
    names: set[str] = set()
    for cls in (torch.nn.Module, torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.optim.Optimizer,
                torch.Generator):
        names.update(dir(cls))
    linear = torch.nn.Linear(2, 2)
    names.update(vars(linear), vars(torch.optim.SGD(linear.parameters(), lr=0.1)))
    return frozenset(n for n in names if _private(n))


def own_private_names(source: str) -> set[str]:
    """The private names ``source`` defines on its own classes: ``self._x = ...`` or
    ``cls._x = ...``, and methods or class attributes named ``_x``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in RECEIVERS_OF_OUR_OWN:
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def torch_attribute_uses(source: str, private: frozenset[str]) -> list[tuple[int, str, str]]:
    """(line, attribute, expression) for each ``x._name`` in ``source`` whose name is in
    ``private`` and whose receiver is not ``self``/``cls``."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private \
                and not (isinstance(node.value, ast.Name) and node.value.id in RECEIVERS_OF_OUR_OWN):
            uses.append((node.lineno, node.attr, ast.unparse(node)))
    return sorted(uses)


def test_torch_private_attributes_are_read_from_torch() -> None:
    private = torch_private_attributes()
    assert {"_parameters", "_buffers", "_modules", "_forward_hooks", "_cdata", "_version", "_base",
            "_optimizer_step_code"} <= private
    assert not any(n.startswith("__") and n.endswith("__") for n in private) and "parameters" not in private


def test_names_zero_ray_shares_with_torchs_private_attributes_are_known() -> None:
    sources = {rel: open(path, encoding="utf-8").read() for rel, path in _library_files().items()}
    ours = set().union(*(own_private_names(s) for s in sources.values()))
    assert ours & torch_private_attributes() == SHARED_WITH_TORCH


def test_no_private_attribute_of_a_torch_object_outside_compat() -> None:
    private = torch_private_attributes() - SHARED_WITH_TORCH
    found = [f"zero_ray/{rel}:{line} {attr} ({expr})" for rel, path in sorted(_library_files().items())
             for line, attr, expr in torch_attribute_uses(open(path, encoding="utf-8").read(), private)]
    assert not found, ("private attributes of torch objects outside zero_ray/compat/ (use public API, or an "
                       "adapter in compat/torch_private.py):\n" + "\n".join(found))


def test_the_attribute_scan_finds_torch_objects_private_attributes_only() -> None:
    source = """
class Owner:
    def __init__(self, module):
        self._parameters = {}
        self._cdata = cls._buffers = None
        own = module._parameters.values()
        key = module.weight.untyped_storage()._cdata
        module.get_submodule("a")._modules["b"] = None
        ok = module.parameters(recurse=False), self._parameters, module.__class__, module._ours
"""
    assert torch_attribute_uses(source, torch_private_attributes()) == [
        (6, "_parameters", "module._parameters"), (7, "_cdata", "module.weight.untyped_storage()._cdata"),
        (8, "_modules", 'module.get_submodule(\'a\')._modules')]
    assert own_private_names(source) == {"_parameters", "_cdata", "_buffers"}


def test_the_scan_finds_each_kind_of_private_use() -> None:
    source = """
import ray.util.collective as col
import torch
import torch.distributed.distributed_c10d as c10d
import ray._private.worker
from ray.experimental.internal_kv import _internal_kv_get
from torch.utils._pytree import tree_flatten

class Group:
    def __init__(self, name):
        self._pg = col.collective.get_group_handle(name)._pg
        self.version = torch.__version__

def reset():
    c10d._world.group_count = 0
    c10d.default_pg_timeout = None
    return torch._C._current_graph_task_id()
"""
    assert private_uses(source) == {
        "col.collective.get_group_handle(name)._pg", "c10d._world", "torch._C", "torch._C._current_graph_task_id",
        "import ray._private.worker", "import ray.experimental.internal_kv._internal_kv_get",
        "import torch.utils._pytree", "patch c10d._world.group_count", "patch c10d.default_pg_timeout"}


@pytest.mark.parametrize("adapter, installed", [
    (ray_private, "2.59.1"), (ray_private, "2.61.0"), (ray_private, "3.0.0"), (ray_private, "nightly"),
    (torch_private, "2.10.0"), (torch_private, "2.15.0"), (torch_private, "3.0.0+cpu"),
])
def test_an_unsupported_version_is_refused_naming_it_and_the_fix(adapter: object, installed: str) -> None:
    package = "ray" if adapter is ray_private else "torch"
    with pytest.raises(UnsupportedVersionError, match=re.escape(f"{package} {installed} is installed")) as info:
        adapter.check_version(installed)  # type: ignore[attr-defined]
    err = info.value
    assert (err.package, err.installed) == (package, installed)
    assert err.supported in str(err) and "install " in str(err)
    assert err.supported == (">=2.60,<2.61" if package == "ray" else ">=2.11,<2.15")


@pytest.mark.parametrize("adapter, installed", [
    (ray_private, "2.60.0"), (ray_private, "2.60.7"), (torch_private, "2.11.0a0+git1a2b3c"),
    (torch_private, "2.13.0+cpu"), (torch_private, "2.14.1"),
])
def test_a_supported_version_is_accepted(adapter: object, installed: str) -> None:
    adapter.check_version(installed)  # type: ignore[attr-defined]


def test_a_missing_private_attribute_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.experimental.internal_kv as kv

    ray_private.check_attributes()
    torch_private.check_attributes()
    monkeypatch.delattr(kv, "_internal_kv_list")
    with pytest.raises(UnsupportedVersionError, match=r"lacks private APIs .*internal_kv\._internal_kv_list"):
        ray_private.check_attributes()
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(UnsupportedVersionError, match=r"lacks private APIs .*_current_graph_task_id"):
        torch_private.check_attributes()


def test_in_backward_is_true_only_while_autograd_runs_a_graph() -> None:
    seen: list[bool] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch_private.in_backward())
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append(torch_private.in_backward())
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not torch_private.in_backward()


def test_default_pg_timeout_applies_inside_the_block_only() -> None:
    before = c10d._get_default_timeout(c10d.Backend("gloo"))
    with pytest.raises(RuntimeError, match="inside"):
        with torch_private.default_pg_timeout(7.5):
            assert c10d._get_default_timeout(c10d.Backend("gloo")) == datetime.timedelta(seconds=7.5)
            raise RuntimeError("inside")
    assert c10d._get_default_timeout(c10d.Backend("gloo")) == before != datetime.timedelta(seconds=7.5)


def test_reset_group_count_zeroes_torchs_count() -> None:
    saved = c10d.get_pg_count()
    c10d._world.group_count = saved + 3
    try:
        torch_private.reset_group_count()
        assert c10d.get_pg_count() == 0
    finally:
        c10d._world.group_count = saved


def test_storage_key_names_a_storage_across_its_views_and_tells_storages_apart() -> None:
    meta = torch.empty(3, 4, device="meta")
    other = torch.empty(3, 4, device="meta")
    assert meta.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()  # why data_ptr cannot serve
    assert torch_private.storage_key(meta[1]) == torch_private.storage_key(meta.t()) == torch_private.storage_key(meta)
    assert torch_private.storage_key(other) != torch_private.storage_key(meta)
    host = torch.zeros(4)
    assert torch_private.storage_key(host[2:]) == torch_private.storage_key(host) != torch_private.storage_key(host.clone())
