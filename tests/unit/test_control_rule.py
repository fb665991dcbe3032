"""The transport rule, read from the sources: Ray creates, places and kills partition owners and
carries data; every control operation on a live owner is a gRPC method of its control service.
So the only Ray actor methods called on an owner anywhere in the package (driver, cli, bench)
are the bootstrap before gRPC can be spoken and the data path; anything else (an actor method
call on a handle, a method name given to FanOut.ray, ``__ray_call__``, a dynamic ``getattr``
call) fails this test, naming the file and line."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

from tests_paths import REPO_ROOT
from zero_ray.driver.fanout import RAY_METHODS

PACKAGE = os.path.join(REPO_ROOT, "zero_ray")

ALLOWED = frozenset({
    # bootstrap: where a new owner runs and its control address; what an attaching driver
    # needs before it can speak gRPC (credentials, the run's config and factories)
    "node", "credentials", "run_spec",
    # the data path: object references of batch pieces, datasets and filesystem objects (Python
    # objects), the explicit consolidation's tensors
    "stage_batch", "register_dataset", "use_filesystem", "master_fragments",
})
# Creating an owner: RemotePartitionOwner.options(...).remote(...); ending one: ray.kill, and the
# task pinned to its node that SIGKILLs a frozen owner's process (driver/terminate.py).
ACTOR_CLASSES = frozenset({"RemotePartitionOwner", "_remote_sigkill"})
# The one dynamic call, checked at run time against RAY_METHODS.
DYNAMIC = ("driver/fanout.py", "FanOut.ray")
# Modules with Ray actors of their own that never reach an owner: the DDP reference runs.
NO_OWNERS = ("testing.py",)


def _sources() -> Iterator[tuple[str, str]]:
    for root, _, files in os.walk(PACKAGE):
        if "_generated" in root:
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                if rel not in NO_OWNERS:
                    yield rel, open(path, encoding="utf-8").read()


def _scopes(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's enclosing ``Class.function`` name."""
    out: dict[ast.AST, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            out[child] = name
            visit(child, name)

    visit(tree, "")
    return out


def violations(source: str, rel: str) -> list[str]:
    """Every Ray actor method call in ``source`` that the rule does not allow, as "file:line: why"."""
    tree = ast.parse(source)
    scopes = _scopes(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr == "__ray_call__":
            found.append(f"{where}: __ray_call__ runs arbitrary code in an actor")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if func.attr == "remote":
            target = func.value
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) \
                    and target.func.attr == "options":
                target = target.func.value  # X.options(...).remote(...): as X.remote(...)
            if isinstance(target, ast.Name):  # an actor class created, or @ray.remote itself
                if target.id != "ray" and target.id not in ACTOR_CLASSES:
                    found.append(f"{where}: {target.id}.remote(...) starts a Ray actor or task")
            elif isinstance(target, ast.Attribute):  # handle.method.remote(...)
                if target.attr not in ALLOWED:
                    found.append(f"{where}: Ray actor method {target.attr!r} is a control operation; call it over "
                                 "gRPC")
            elif isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "getattr":
                if (rel, scopes.get(node, "")) != DYNAMIC:
                    found.append(f"{where}: getattr(...).remote(...) hides which actor method is called")
            else:
                found.append(f"{where}: a .remote(...) call whose target cannot be read")
        elif func.attr == "ray" and len(node.args) >= 2:  # FanOut.ray(actors, "method", ...)
            method = node.args[1]
            if not (isinstance(method, ast.Constant) and isinstance(method.value, str)):
                found.append(f"{where}: FanOut.ray with a method name that is not a literal")
            elif method.value not in ALLOWED:
                found.append(f"{where}: FanOut.ray(..., {method.value!r}) is a control operation; call it over gRPC")
    return found


def test_no_ray_actor_method_is_called_on_an_owner_but_bootstrap_and_data() -> None:
    found = [v for rel, source in _sources() for v in violations(source, rel)]
    assert found == []


def test_fanout_refuses_at_run_time_what_the_rule_refuses() -> None:
    assert RAY_METHODS == ALLOWED


def test_the_exempt_modules_never_reach_an_owner() -> None:
    for rel in NO_OWNERS:
        tree = ast.parse(open(os.path.join(PACKAGE, rel), encoding="utf-8").read())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m.startswith(("zero_ray.owner", "zero_ray.driver"))}, rel
        assert not any(isinstance(n, ast.Attribute) and n.attr == "actors" for n in ast.walk(tree)), rel


@pytest.mark.parametrize("planted", [
    "ray.get(pool.actors[0].reshard.remote(old_world=2, new_world=3, generation=1, info={}))",
    "ray.get([a.status.remote() for a in handles])",
    "self.fan.ray(self.actors, 'reform', 3, timeout_s=1.0)",
    "self.fan.ray(self.actors, method, timeout_s=1.0)",
    "ray.get(actor.__ray_call__.remote(lambda self: self.engine))",
    "getattr(actor, 'rebuild').remote(position=0)",
    "actor.memory_report.options(name='x').remote()",
    "Helper.remote()",
])
def test_a_planted_violation_is_found(planted: str) -> None:
    assert violations(planted, "driver/pool.py") != []


@pytest.mark.parametrize("allowed", [
    "RemotePartitionOwner.options(num_cpus=1, name='x').remote(rank=0, world_size=1, spec=s, options=o)",
    "ray.get(trainer.actors[1].node.remote(), timeout=60)",
    "self.fan.ray(actors, 'register_dataset', name, source, timeout_s=1.0)",
    "[a.stage_batch.remote(key, piece) for a, piece in zip(self.actors, pieces)]",
    "ray.kill(actor, no_restart=True)",
    "RemotePartitionOwner = ray.remote(PartitionOwner)",
])
def test_the_allowed_forms_pass(allowed: str) -> None:
    assert violations(allowed, "driver/pool.py") == []
